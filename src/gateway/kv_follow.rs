//! Exact routing's gateway side: one task per worker follows the worker's KV-cache events
//! (`GET /cache/events`) into the shared [`KvIndex`], and each request is tokenized once,
//! with the vocabulary the workers serve (`GET /cache/vocabulary`), into the chained block
//! hashes the index is looked up with.
//!
//! A stream that breaks marks its worker unsynced (nothing cached is assumed there) and is
//! reopened with backoff; a gap in its sequence numbers reopens it at once, and the new
//! stream's snapshot resyncs the index. A worker that restarted shows a new instance in that
//! snapshot, which replaces everything held for it.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use actix_web::web::Bytes;
use futures_util::StreamExt;

use super::kv_index::{block_hashes, Applied, KvEvent, KvIndex};
use super::request_text::Endpoint;
use super::tree::WorkerId;
use super::workers::Worker;
use crate::actors::prompt_tokens;
use crate::actors::remote::vocabulary::WireVocabulary;
use crate::model::Vocabulary;
use crate::scheduler::PrefixHash;
use crate::server::kv_events::KvStreamEvent;

/// Why a worker's stream stopped being followed.
#[derive(Debug)]
pub enum FollowError {
    /// The events skipped a number: reopen at once, the new snapshot resyncs.
    Gap(String),
    /// The worker's blocks cannot be indexed with the others' (another block size, another
    /// hash): said once as a warning, retried with backoff.
    Incompatible(String),
    /// The connection failed or the stream broke: retried with backoff.
    Broken(String),
}

impl From<String> for FollowError {
    fn from(why: String) -> Self {
        Self::Broken(why)
    }
}

/// What exact routing shares: the index, the vocabulary and the workers' block size.
pub struct ExactRouting {
    pub index: Arc<KvIndex>,
    vocabulary: OnceLock<Arc<Vocabulary>>,
    /// Tokens per block, from the first snapshot (0 until then).
    block_size: AtomicUsize,
    /// Sent as `Authorization: Bearer` to the workers' event streams.
    worker_api_key: Option<String>,
}

/// A request's place in the index: its prompt tokens and chained block hashes.
pub struct RequestBlocks {
    pub prompt_tokens: usize,
    pub block_size: usize,
    pub hashes: Vec<PrefixHash>,
}

impl ExactRouting {
    pub fn new(index: Arc<KvIndex>, worker_api_key: Option<String>) -> Self {
        Self {
            index,
            vocabulary: OnceLock::new(),
            block_size: AtomicUsize::new(0),
            worker_api_key,
        }
    }

    /// The request's blocks, once the vocabulary and block size are known and the body reads
    /// as the endpoint's request; `None` otherwise (the request is then routed by load, and
    /// the worker answers a bad body with its own error).
    pub fn blocks(&self, endpoint: Endpoint, body: &[u8]) -> Option<RequestBlocks> {
        let vocabulary = self.vocabulary.get()?;
        let block_size = self.block_size.load(Ordering::Acquire);
        if block_size == 0 {
            return None;
        }
        let request = endpoint.api().parse_request(body).ok()?;
        let tokens = prompt_tokens(vocabulary, &request.prompt).ok()?;
        Some(RequestBlocks {
            prompt_tokens: tokens.len(),
            block_size,
            hashes: block_hashes(&tokens, block_size),
        })
    }

    fn get(&self, client: &awc::Client, url: String) -> awc::ClientRequest {
        let request = client.get(url);
        match &self.worker_api_key {
            Some(key) => request.bearer_auth(key),
            None => request,
        }
    }

    /// Fetches the vocabulary from `worker` unless one is already held.
    async fn fetch_vocabulary(&self, client: &awc::Client, worker: &Worker) -> Result<(), String> {
        if self.vocabulary.get().is_some() {
            return Ok(());
        }
        let mut response = (self.get(client, format!("{}/cache/vocabulary", worker.url)))
            .send()
            .await
            .map_err(|e| e.to_string())?;
        if !response.status().is_success() {
            return Err(format!("/cache/vocabulary answered {}", response.status()));
        }
        let wire: WireVocabulary = response
            .json()
            .limit(256 << 20)
            .await
            .map_err(|e| format!("/cache/vocabulary: {e}"))?;
        let vocabulary = wire.into_vocabulary()?;
        let _ = self.vocabulary.set(Arc::new(vocabulary));
        Ok(())
    }

    /// Applies one event of `worker`'s stream; `Err` when the stream must be reopened.
    pub fn apply(&self, worker: WorkerId, event: KvStreamEvent) -> Result<(), FollowError> {
        let (seq, hashes, stored) = match event {
            KvStreamEvent::Snapshot {
                instance,
                block_size,
                capacity,
                hash_check,
                seq,
                hashes,
                ..
            } => {
                let known = self.block_size.load(Ordering::Acquire);
                if known != 0 && known != block_size {
                    return Err(FollowError::Incompatible(format!(
                        "block size {block_size}, but other workers use {known}: not indexed"
                    )));
                }
                if hash_check != crate::scheduler::hash_check() {
                    return Err(FollowError::Incompatible(
                        "it hashes blocks unlike this gateway (another build?): not indexed".into(),
                    ));
                }
                self.block_size.store(block_size, Ordering::Release);
                self.index.snapshot(worker, &instance, seq, &hashes);
                self.index.set_capacity(worker, capacity);
                return Ok(());
            }
            KvStreamEvent::Stored { seq, hashes } => (seq, hashes, true),
            KvStreamEvent::Removed { seq, hashes } => (seq, hashes, false),
        };
        let event = match stored {
            true => KvEvent::Stored { seq, hashes },
            false => KvEvent::Removed { seq, hashes },
        };
        match self.index.apply(worker, &event) {
            Applied::Ok => Ok(()),
            Applied::Gap { expected, got } => Err(FollowError::Gap(format!(
                "event {got} where {expected} was due: resyncing"
            ))),
        }
    }

    /// Follows one stream until it ends or breaks.
    async fn stream_once(&self, client: &awc::Client, worker: &Worker) -> Result<(), FollowError> {
        self.fetch_vocabulary(client, worker).await?;
        let mut response = (self.get(client, format!("{}/cache/events", worker.url)))
            .send()
            .await
            .map_err(|e| FollowError::Broken(e.to_string()))?;
        if !response.status().is_success() {
            let status = response.status();
            return Err(FollowError::Broken(format!(
                "/cache/events answered {status}"
            )));
        }
        let mut reader = EventReader::default();
        loop {
            // A live stream sends at least a keep-alive every 10 s.
            let next = tokio::time::timeout(Duration::from_secs(30), response.next()).await;
            let chunk: Bytes = match next {
                Err(_) => return Err(FollowError::Broken("the stream went quiet".into())),
                Ok(None) => return Err(FollowError::Broken("the stream ended".into())),
                Ok(Some(chunk)) => chunk.map_err(|e| FollowError::Broken(e.to_string()))?,
            };
            for event in reader.push(&chunk)? {
                if worker.is_retired() {
                    return Ok(());
                }
                self.apply(worker.id, event?)?;
            }
        }
    }
}

/// The longest event a worker may send (a snapshot of a million blocks is about 21 MB).
const MAX_EVENT_BYTES: usize = 256 << 20;

/// Splits a worker's event stream, as its chunks arrive, into events.
#[derive(Default)]
pub struct EventReader {
    /// Bytes of an event not yet whole.
    pending: Vec<u8>,
    /// How far `pending` is known to hold no event end.
    scanned: usize,
}

impl EventReader {
    /// The events `chunk` completes, each the JSON of its `data` lines or why it is not one
    /// (comment lines, the keep-alives, carry no data and give nothing); `Err` when an event
    /// grows beyond any a worker sends.
    pub fn push(&mut self, chunk: &[u8]) -> Result<Vec<Result<KvStreamEvent, String>>, String> {
        self.pending.extend_from_slice(chunk);
        let mut out = Vec::new();
        loop {
            let from = self.scanned.saturating_sub(1);
            let Some(at) = self.pending[from..].windows(2).position(|w| w == b"\n\n") else {
                break;
            };
            let block: Vec<u8> = self.pending.drain(..from + at + 2).collect();
            self.scanned = 0;
            let text = String::from_utf8_lossy(&block);
            for data in text.lines().filter_map(|l| l.strip_prefix("data:")) {
                out.push(
                    serde_json::from_str(data.trim())
                        .map_err(|e| format!("an event is not JSON ({e})")),
                );
            }
        }
        self.scanned = self.pending.len();
        if self.pending.len() > MAX_EVENT_BYTES {
            return Err(format!("an event exceeds {MAX_EVENT_BYTES} bytes"));
        }
        Ok(out)
    }
}

/// Follows `worker`'s events until it leaves the gateway.
pub async fn follow(exact: Arc<ExactRouting>, worker: Arc<Worker>) {
    // The stream stays open for as long as the worker lives: no overall deadline (a quiet
    // one is caught by `stream_once`).
    let client = awc::Client::builder()
        .connector(awc::Connector::new().timeout(Duration::from_secs(5)))
        .timeout(Duration::from_secs(365 * 24 * 3600))
        .finish();
    let mut backoff = Duration::from_millis(100);
    let mut warned = false;
    while !worker.is_retired() {
        let opened = std::time::Instant::now();
        let outcome = exact.stream_once(&client, &worker).await;
        if opened.elapsed() > Duration::from_secs(5) {
            backoff = Duration::from_millis(100);
        }
        exact.index.unsync(worker.id);
        if worker.is_retired() {
            break;
        }
        match outcome {
            Err(FollowError::Gap(why)) => {
                tracing::info!(worker = %worker.url, "{why}");
                continue;
            }
            Err(FollowError::Incompatible(why)) if !warned => {
                tracing::warn!(worker = %worker.url, "KV events: {why}");
                warned = true;
            }
            Err(FollowError::Incompatible(_)) => {}
            Err(FollowError::Broken(why)) => {
                tracing::debug!(worker = %worker.url, "KV events: {why}")
            }
            Ok(()) => {}
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
    exact.index.remove_worker(worker.id);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snapshot(block_size: usize, hash_check: u64) -> KvStreamEvent {
        KvStreamEvent::Snapshot {
            instance: "i".into(),
            model: "m".into(),
            block_size,
            capacity: 8,
            hash_check,
            seq: 4,
            hashes: vec![1, 2],
        }
    }

    #[test]
    fn workers_whose_blocks_do_not_compare_are_not_indexed() {
        let exact = ExactRouting::new(Arc::new(KvIndex::new()), None);
        let check = crate::scheduler::hash_check();
        assert!(exact.apply(0, snapshot(16, check)).is_ok());
        let other_hash = exact.apply(1, snapshot(16, check ^ 1));
        assert!(matches!(other_hash, Err(FollowError::Incompatible(_))));
        let other_size = exact.apply(2, snapshot(8, check));
        assert!(matches!(other_size, Err(FollowError::Incompatible(_))));
        let gap = exact.apply(
            0,
            KvStreamEvent::Stored {
                seq: 9,
                hashes: vec![3],
            },
        );
        assert!(matches!(gap, Err(FollowError::Gap(_))));
        let held: Vec<usize> = exact.index.workers().iter().map(|w| w.blocks).collect();
        assert_eq!(held, [2], "only worker 0 is indexed");
    }

    #[test]
    fn events_are_split_whatever_the_chunks() {
        let events = [
            KvStreamEvent::Stored {
                seq: 1,
                hashes: vec![7, 8],
            },
            KvStreamEvent::Removed {
                seq: 3,
                hashes: vec![7],
            },
        ];
        let text: String = events.iter().map(KvStreamEvent::to_sse).collect::<String>()
            + ": keepalive\n\ndata: not json\n\n";
        for size in [1, 2, 5, 64, 4096] {
            let mut reader = EventReader::default();
            let mut got = Vec::new();
            for chunk in text.as_bytes().chunks(size) {
                got.extend(reader.push(chunk).unwrap());
            }
            assert_eq!(got.len(), 3, "chunks of {size}");
            assert_eq!(got[0].as_ref().unwrap(), &events[0]);
            assert_eq!(got[1].as_ref().unwrap(), &events[1]);
            assert!(got[2].as_ref().unwrap_err().contains("not JSON"));
        }
    }
}
