//! The server's API as an OpenAPI 3.1 document (`GET /openapi.json`), derived from the request
//! types the handlers parse (`schema.rs`) and the response types they send (`bodies.rs`), so
//! that the document and the answers cannot drift apart.

use utoipa::openapi::path::Operation;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityRequirement, SecurityScheme};
use utoipa::openapi::{Ref, ResponseBuilder};
use utoipa::{Modify, OpenApi};

use super::bodies::{ChatChunkChoice, Chunk, ErrorBody, TextChunkChoice, STREAM_EVENTS};
use super::handlers;

#[derive(OpenApi)]
#[openapi(
    info(
        title = "tokenrouter",
        description = "Token-level routed LLM inference: OpenAI- and SGLang-compatible API."
    ),
    paths(
        handlers::chat,
        handlers::completions,
        handlers::generate,
        handlers::models,
        handlers::health,
        handlers::health_generate,
        handlers::server_info,
        handlers::metrics,
        handlers::cache_match,
        super::kv_events::cache_events,
        super::kv_events::cache_vocabulary,
        handlers::openapi,
    ),
    components(schemas(
        ErrorBody,
        Chunk<ChatChunkChoice>,
        Chunk<TextChunkChoice>,
        super::schema::RequestApi
    )),
    modifiers(&Errors),
)]
pub struct ApiDoc;

/// The document of a server answering to `models` with a vocabulary of `vocab_size` tokens:
/// the names a request's `model` may take, and the token ids a prompt may hold, are this
/// server's own.
pub fn document(models: &[String], vocab_size: usize) -> String {
    let mut doc = serde_json::to_value(ApiDoc::openapi()).expect("the OpenAPI document serializes");
    let schemas = &mut doc["components"]["schemas"];
    schemas["ModelName"]["enum"] = serde_json::json!(models);
    schemas["TokenId"]["maximum"] = serde_json::json!(vocab_size.saturating_sub(1));
    // An event's `data` is JSON (JSON Schema's contentMediaType / contentSchema, which
    // OpenAPI 3.1 validators apply to each event of a stream), except the closing `[DONE]`.
    for (event, payload) in STREAM_EVENTS {
        schemas[event]["properties"]["data"] = serde_json::json!({
            "type": "string",
            "if": {"const": "[DONE]"},
            "else": {
                "contentMediaType": "application/json",
                "contentSchema": {"anyOf": [
                    {"$ref": format!("#/components/schemas/{payload}")},
                    {"$ref": "#/components/schemas/ErrorBody"},
                ]},
            },
        });
    }
    doc.to_string()
}

/// The errors every route may answer, each with the OpenAI-style error body: added to every
/// operation here rather than repeated on each handler.
struct Errors;

/// Errors of the routes that take a request body and generate.
const BODY_ERRORS: [(&str, &str); 5] = [
    (
        "400",
        "The request is malformed; `error.param` names the field at fault.",
    ),
    ("404", "The model asked for is not served here."),
    ("413", "The body is past the server's limit."),
    (
        "503",
        "The server is at its request limit (with Retry-After), or a model is down.",
    ),
    ("504", "The request ran past the server's request timeout."),
];

impl Modify for Errors {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.security_schemes.insert(
            "api_key".into(),
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()).into(),
        );
        for (path, item) in openapi.paths.paths.iter_mut() {
            let operations = [&mut item.get, &mut item.post];
            for (post, operation) in operations.into_iter().enumerate() {
                let Some(operation) = operation else {
                    continue;
                };
                if path != "/health" {
                    add_error(operation, "401", "The API key is missing or wrong.");
                    // Open without a key, or with one where the server sets keys.
                    operation.security = Some(vec![
                        SecurityRequirement::default(),
                        SecurityRequirement::new("api_key", Vec::<String>::new()),
                    ]);
                }
                if post == 1 {
                    for (status, description) in BODY_ERRORS {
                        add_error(operation, status, description);
                    }
                }
            }
        }
    }
}

fn add_error(operation: &mut Operation, status: &str, description: &str) {
    let response = ResponseBuilder::new()
        .description(description)
        .content(
            "application/json",
            utoipa::openapi::ContentBuilder::new()
                .schema(Some(Ref::from_schema_name("ErrorBody")))
                .build(),
        )
        .build();
    operation
        .responses
        .responses
        .entry(status.into())
        .or_insert(response.into());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_route_is_documented_with_its_errors() {
        let text = document(&["served".into(), "slm".into()], 100);
        let doc: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(doc["openapi"], "3.1.0");
        let paths = doc["paths"].as_object().unwrap();
        for path in [
            "/v1/chat/completions",
            "/v1/completions",
            "/generate",
            "/v1/models",
            "/health",
            "/health_generate",
            "/get_server_info",
            "/metrics",
            "/cache/match",
            "/openapi.json",
        ] {
            assert!(paths.contains_key(path), "{path} is missing");
        }
        let chat = &paths["/v1/chat/completions"]["post"];
        for status in ["200", "400", "401", "404", "413", "503", "504"] {
            assert!(chat["responses"].get(status).is_some(), "chat {status}");
        }
        // The sampling fields are part of the request schema, with their ranges.
        let schemas = &doc["components"]["schemas"];
        assert!(text.contains("\"temperature\""), "{text}");
        assert_eq!(schemas["ModelName"]["enum"][1], "slm");
        assert_eq!(schemas["TokenId"]["maximum"], 99);
        for (event, payload) in STREAM_EVENTS {
            assert!(schemas.get(payload).is_some(), "{payload}");
            let data = &schemas[event]["properties"]["data"];
            assert_eq!(
                data["else"]["contentMediaType"], "application/json",
                "{event}"
            );
        }
        assert!(schemas.get("Completion_ChatChoice").is_some());
        assert!(schemas.get("ErrorBody").is_some());
    }
}
