//! API keys: `Authorization: Bearer <key>` on every route but `/health`, for the server and
//! the gateway alike. Keys are compared in constant time, every key whatever the outcome, so
//! the time taken says nothing of which key came close.

use actix_web::body::{BoxBody, EitherBody};
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::StatusCode;

use super::error::ApiError;

/// Whether `req` may pass: no keys are set, it asks for `/health`, or it carries one of `keys`.
pub fn authorized(req: &ServiceRequest, keys: &[String]) -> bool {
    if keys.is_empty() || req.path() == "/health" {
        return true;
    }
    let given = req
        .headers()
        .get("Authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    keys.iter().fold(false, |ok, key| {
        ok | constant_time_eq::constant_time_eq(given.as_bytes(), key.as_bytes())
    })
}

/// The 401 for a request without a valid key, with an OpenAI-style body.
pub fn unauthorized<B>(req: ServiceRequest) -> ServiceResponse<EitherBody<B, BoxBody>> {
    let error = ApiError::new(
        StatusCode::UNAUTHORIZED,
        "missing or wrong API key: send Authorization: Bearer <key>",
    );
    let response = actix_web::ResponseError::error_response(&error);
    req.into_response(response).map_into_right_body()
}
