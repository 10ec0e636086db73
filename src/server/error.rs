//! The one place that turns failures into HTTP: an OpenAI-style error body
//! (`{"error": {"message", "type", "param", "code"}}`) with a 4xx or 5xx status.

use actix_web::http::StatusCode;
use actix_web::{HttpResponse, ResponseError};

use super::bodies::{ErrorBody, ErrorDetail};
use crate::actors::request::{ErrorKind, RequestError};

#[derive(Debug, Clone, thiserror::Error)]
#[error("{message}")]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// The request field at fault, when one is.
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// Seconds a client should wait before retrying (503).
    pub retry_after: Option<u64>,
}

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            param: None,
            code: None,
            retry_after: None,
        }
    }

    /// A 400 naming the field at fault.
    pub fn invalid(param: &str, message: impl Into<String>) -> Self {
        let mut e = Self::new(StatusCode::BAD_REQUEST, message);
        e.param = Some(param.to_string());
        e
    }

    pub fn model_not_found(model: &str, served: &str) -> Self {
        let mut e = Self::new(
            StatusCode::NOT_FOUND,
            format!("model: the model '{model}' does not exist; this server serves '{served}'"),
        );
        e.param = Some("model".into());
        e.code = Some("model_not_found");
        e
    }

    pub fn overloaded(waiting: usize) -> Self {
        let mut e = Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("the server is at its limit of {waiting} requests; retry shortly"),
        );
        e.retry_after = Some(1);
        e
    }

    fn kind(&self) -> &'static str {
        match self.status.as_u16() {
            401 => "authentication_error",
            400..=499 => "invalid_request_error",
            503 => "overloaded_error",
            _ => "internal_server_error",
        }
    }
}

impl From<RequestError> for ApiError {
    fn from(e: RequestError) -> Self {
        let status = match e.kind {
            ErrorKind::InvalidRequest => StatusCode::BAD_REQUEST,
            ErrorKind::Internal => StatusCode::INTERNAL_SERVER_ERROR,
            ErrorKind::Timeout => StatusCode::GATEWAY_TIMEOUT,
            ErrorKind::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        };
        // Runtime messages start with the field they name ("max_tokens: ...").
        let param = e
            .message
            .split_once(':')
            .map(|(p, _)| p)
            .filter(|p| !p.contains(' '))
            .map(str::to_string);
        Self {
            param: param.filter(|_| status == StatusCode::BAD_REQUEST),
            ..Self::new(status, e.message)
        }
    }
}

impl ResponseError for ApiError {
    fn status_code(&self) -> StatusCode {
        self.status
    }

    fn error_response(&self) -> HttpResponse {
        let mut response = HttpResponse::build(self.status);
        if let Some(secs) = self.retry_after {
            response.insert_header(("Retry-After", secs.to_string()));
        }
        response.json(self.body())
    }
}

impl ApiError {
    /// The JSON error object (also sent as a final SSE event when a stream fails).
    pub fn body(&self) -> ErrorBody {
        ErrorBody {
            error: ErrorDetail {
                message: self.message.clone(),
                kind: self.kind(),
                param: self.param.clone(),
                code: (self.code.map(str::to_string))
                    .unwrap_or_else(|| self.status.as_u16().to_string()),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runtime_errors_keep_the_field_they_name() {
        let e = ApiError::from(RequestError::invalid("max_tokens: must be at least 1"));
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
        let body = serde_json::to_value(e.body()).unwrap();
        assert_eq!(body["error"]["type"], "invalid_request_error");
        assert_eq!(body["error"]["param"], "max_tokens");
    }

    #[test]
    fn overload_is_a_503_with_retry_after() {
        let response = ApiError::overloaded(8).error_response();
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(response.headers().get("Retry-After").unwrap(), "1");
    }
}
