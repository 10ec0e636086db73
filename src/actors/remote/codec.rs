//! A link's framing: any serde message as bincode 2 behind a 4-byte length prefix
//! (tokio-util's codec), size-limited both ways, and the counters of the link's traffic and
//! health that the codec and the link's tasks keep.

use std::io;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{BufMut, BytesMut};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio_util::codec::{Decoder, Encoder, LengthDelimitedCodec};

use crate::actors::messages::LinkStats;

/// The largest frame either side sends or accepts. The largest real one is a handoff with
/// 16 drafts' full-vocabulary distributions (about 20 MB at a 152k vocabulary).
pub const MAX_FRAME_BYTES: usize = 64 << 20;

#[derive(Debug, thiserror::Error)]
pub enum ProtocolError {
    #[error("{0}")]
    Io(#[from] io::Error),
    #[error("malformed frame: {0}")]
    Decode(#[from] bincode::error::DecodeError),
    #[error("cannot encode a frame: {0}")]
    Encode(#[from] bincode::error::EncodeError),
    #[error("malformed frame: {0} bytes left over after the message")]
    Trailing(usize),
}

fn bincode_config() -> impl bincode::config::Config {
    bincode::config::standard().with_limit::<MAX_FRAME_BYTES>()
}

/// A link's traffic and health, shared by its codec, its tasks and its owner, and kept
/// across reconnections.
pub struct LinkCounters {
    epoch: Instant,
    pub frames_in: AtomicU64,
    pub frames_out: AtomicU64,
    pub bytes_in: AtomicU64,
    pub bytes_out: AtomicU64,
    /// The last round trip, in µs.
    pub rtt_us: AtomicU64,
    /// When a frame last arrived, in µs since the epoch.
    heard_us: AtomicU64,
}

impl Default for LinkCounters {
    fn default() -> Self {
        Self {
            epoch: Instant::now(),
            frames_in: AtomicU64::new(0),
            frames_out: AtomicU64::new(0),
            bytes_in: AtomicU64::new(0),
            bytes_out: AtomicU64::new(0),
            rtt_us: AtomicU64::new(0),
            heard_us: AtomicU64::new(0),
        }
    }
}

impl LinkCounters {
    /// µs since the counters were made: the clock pings carry.
    pub fn now_us(&self) -> u64 {
        self.epoch.elapsed().as_micros() as u64
    }

    pub fn heard(&self) {
        self.heard_us.store(self.now_us(), Ordering::Relaxed);
    }

    /// How long since a frame arrived.
    pub fn silence(&self) -> Duration {
        let heard = self.heard_us.load(Ordering::Relaxed);
        Duration::from_micros(self.now_us().saturating_sub(heard))
    }

    /// A ping sent at `sent` (µs) came back.
    pub fn pong(&self, sent: u64) {
        self.rtt_us
            .store(self.now_us().saturating_sub(sent), Ordering::Relaxed);
    }

    pub fn snapshot(&self, up: bool, reconnects: u64) -> LinkStats {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        LinkStats {
            up,
            frames_in: get(&self.frames_in),
            frames_out: get(&self.frames_out),
            bytes_in: get(&self.bytes_in),
            bytes_out: get(&self.bytes_out),
            rtt_us: get(&self.rtt_us),
            reconnects,
        }
    }
}

/// Length-prefixed bincode frames of `T`, counted into `counters` when given.
pub struct Codec<T> {
    frames: LengthDelimitedCodec,
    /// Frames read are at most [`SMALL_FRAME_BYTES`] (and so is what they claim to hold).
    small: bool,
    counters: Option<Arc<LinkCounters>>,
    _item: PhantomData<fn() -> T>,
}

impl<T> Default for Codec<T> {
    fn default() -> Self {
        Self {
            frames: LengthDelimitedCodec::builder()
                .max_frame_length(MAX_FRAME_BYTES)
                .new_codec(),
            small: false,
            counters: None,
            _item: PhantomData,
        }
    }
}

/// The limit of [`Codec::small`].
pub const SMALL_FRAME_BYTES: usize = 64 << 10;

impl<T> Codec<T> {
    /// Frames read are limited to [`SMALL_FRAME_BYTES`]: for what a peer that has not proved
    /// the secret may send, so that it cannot make this side buffer or allocate more.
    pub fn small() -> Self {
        Self {
            frames: LengthDelimitedCodec::builder()
                .max_frame_length(SMALL_FRAME_BYTES)
                .new_codec(),
            small: true,
            ..Self::default()
        }
    }

    pub fn counted(counters: Arc<LinkCounters>) -> Self {
        Self {
            counters: Some(counters),
            ..Self::default()
        }
    }

    fn count(&self, frames: fn(&LinkCounters) -> (&AtomicU64, &AtomicU64), bytes: usize) {
        if let Some(c) = &self.counters {
            let (n, b) = frames(c);
            n.fetch_add(1, Ordering::Relaxed);
            // The payload and its length prefix.
            b.fetch_add(bytes as u64 + 4, Ordering::Relaxed);
        }
    }
}

impl<T: DeserializeOwned> Decoder for Codec<T> {
    type Item = T;
    type Error = ProtocolError;

    fn decode(&mut self, src: &mut BytesMut) -> Result<Option<T>, ProtocolError> {
        let Some(bytes) = self.frames.decode(src)? else {
            return Ok(None);
        };
        self.count(|c| (&c.frames_in, &c.bytes_in), bytes.len());
        let (item, read) = if self.small {
            let config = bincode::config::standard().with_limit::<SMALL_FRAME_BYTES>();
            bincode::serde::decode_from_slice(&bytes, config)?
        } else {
            bincode::serde::decode_from_slice(&bytes, bincode_config())?
        };
        match bytes.len() - read {
            0 => Ok(Some(item)),
            left => Err(ProtocolError::Trailing(left)),
        }
    }
}

impl<T: Serialize> Encoder<T> for Codec<T> {
    type Error = ProtocolError;

    /// Encodes in place behind the length prefix the decoder's `LengthDelimitedCodec` reads
    /// (4 bytes, big-endian), so a frame costs no allocation of its own.
    fn encode(&mut self, item: T, dst: &mut BytesMut) -> Result<(), ProtocolError> {
        let start = dst.len();
        dst.put_u32(0);
        let written = bincode::serde::encode_into_std_write(
            &item,
            &mut (&mut *dst).writer(),
            bincode_config(),
        );
        let len = dst.len() - start - 4;
        if let Err(e) = written {
            dst.truncate(start);
            return Err(e.into());
        }
        if len > MAX_FRAME_BYTES {
            dst.truncate(start);
            return Err(ProtocolError::Io(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("a frame of {len} bytes exceeds the limit of {MAX_FRAME_BYTES}"),
            )));
        }
        dst[start..start + 4].copy_from_slice(&(len as u32).to_be_bytes());
        self.count(|c| (&c.frames_out, &c.bytes_out), len);
        Ok(())
    }
}
