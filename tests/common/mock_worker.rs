//! A stand-in for a tokenrouter server behind the gateway: answers the generation routes with
//! a body naming itself, streams slowly when asked, fails with a chosen status, reports
//! `/health` as told, and counts requests and streams the client abandoned.

use std::net::TcpListener;
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use actix_web::web::{self, Bytes};
use actix_web::{App, HttpResponse, HttpServer};
use futures_util::stream;

#[derive(Default)]
pub struct MockState {
    pub name: String,
    /// Status every generation request gets (0: a normal answer).
    pub fail_status: AtomicU16,
    pub unhealthy: AtomicBool,
    /// SSE chunks per streamed answer, and the pause before each.
    pub chunks: AtomicUsize,
    pub chunk_ms: AtomicU64,
    /// Dies at this chunk of a stream (0: never): sends half an event, then drops the
    /// connection, as a killed server does.
    pub die_at: AtomicUsize,
    pub requests: AtomicUsize,
    /// Streams dropped before their last chunk (the client went away).
    pub disconnects: AtomicUsize,
    pub completed: AtomicUsize,
    pub bodies: Mutex<Vec<serde_json::Value>>,
}

pub struct MockWorker {
    pub state: Arc<MockState>,
    pub url: String,
    pub port: u16,
    server: actix_web::dev::ServerHandle,
}

impl Drop for MockWorker {
    fn drop(&mut self) {
        let stop = self.server.stop(false);
        let _ = std::thread::spawn(move || actix_web::rt::System::new().block_on(stop)).join();
    }
}

/// Counts a stream as abandoned unless it reached its end.
struct StreamEnd {
    state: Arc<MockState>,
    finished: bool,
}

impl Drop for StreamEnd {
    fn drop(&mut self) {
        let counter = if self.finished {
            &self.state.completed
        } else {
            &self.state.disconnects
        };
        counter.fetch_add(1, Ordering::SeqCst);
    }
}

async fn generation(state: web::Data<MockState>, body: Bytes) -> HttpResponse {
    let state = state.into_inner();
    state.requests.fetch_add(1, Ordering::SeqCst);
    let json: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    state.bodies.lock().unwrap().push(json.clone());
    let fail = state.fail_status.load(Ordering::SeqCst);
    if fail != 0 {
        let status = actix_web::http::StatusCode::from_u16(fail).unwrap();
        return HttpResponse::build(status)
            .json(serde_json::json!({"error": {"message": format!("{} fails", state.name)}}));
    }
    if !json["stream"].as_bool().unwrap_or(false) {
        state.completed.fetch_add(1, Ordering::SeqCst);
        return HttpResponse::Ok().json(serde_json::json!({"worker": state.name}));
    }
    let chunks = state.chunks.load(Ordering::SeqCst).max(1);
    let pause = Duration::from_millis(state.chunk_ms.load(Ordering::SeqCst));
    let die_at = state.die_at.load(Ordering::SeqCst);
    let end = StreamEnd {
        state: state.clone(),
        finished: false,
    };
    let events = stream::unfold((0, end), move |(i, mut end)| async move {
        if i > chunks {
            return None;
        }
        tokio::time::sleep(pause).await;
        if die_at > 0 && i > die_at {
            let dead = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "killed");
            return Some((Err(actix_web::Error::from(dead)), (i + 1, end)));
        }
        let data = if die_at > 0 && i == die_at {
            format!("data: {{\"worker\": \"{}\", \"i\"", end.state.name)
        } else if i == chunks {
            end.finished = true;
            "data: [DONE]\n\n".to_string()
        } else {
            format!(
                "data: {{\"worker\": \"{}\", \"i\": {i}}}\n\n",
                end.state.name
            )
        };
        Some((Ok::<_, actix_web::Error>(Bytes::from(data)), (i + 1, end)))
    });
    HttpResponse::Ok()
        .content_type("text/event-stream")
        .streaming(events)
}

async fn health(state: web::Data<MockState>) -> HttpResponse {
    if state.unhealthy.load(Ordering::SeqCst) {
        HttpResponse::ServiceUnavailable().finish()
    } else {
        HttpResponse::Ok().finish()
    }
}

impl MockWorker {
    pub fn start(name: &str) -> Self {
        let state = Arc::new(MockState {
            name: name.to_string(),
            chunks: AtomicUsize::new(3),
            ..Default::default()
        });
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let data = web::Data::from(state.clone());
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            actix_web::rt::System::new().block_on(async move {
                let server = HttpServer::new(move || {
                    App::new()
                        .app_data(data.clone())
                        .route("/v1/chat/completions", web::post().to(generation))
                        .route("/v1/completions", web::post().to(generation))
                        .route("/generate", web::post().to(generation))
                        .route("/health", web::get().to(health))
                        .route(
                            "/v1/models",
                            web::get().to(|| async {
                                HttpResponse::Ok()
                                    .json(serde_json::json!({"object": "list", "data": []}))
                            }),
                        )
                })
                .workers(1)
                .disable_signals()
                .listen(listener)
                .unwrap()
                .run();
                tx.send(server.handle()).unwrap();
                server.await
            })
        });
        let server = rx.recv().unwrap();
        Self {
            state,
            url: format!("http://127.0.0.1:{port}"),
            port,
            server,
        }
    }

    pub fn requests(&self) -> usize {
        self.state.requests.load(Ordering::SeqCst)
    }
}
