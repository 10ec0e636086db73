//! The actor runtime: one [`ModelActor`] per model, one [`RequestActor`] per request, and the
//! messages between them. Actors are thin: they deliver messages to plain structs
//! ([`worker::ModelWorker`], [`request::RequestState`]) that hold all state and logic, so the
//! actor library could be replaced without touching scheduling or routing.

pub mod executor;
pub mod messages;
pub mod model_actor;
pub mod remote;
pub mod request;
pub mod runtime;
pub mod worker;

pub use model_actor::ModelActor;
pub use request::{
    prompt_tokens, GenerateRequest, Prompt, RequestActor, RequestEvent, RequestHandle,
    RuntimeShared, Summary,
};
pub use runtime::{load_model, load_models, run_subserver, Runtime, SubserverArgs};
