//! One open link's input and output, as two tasks on the owning actor's arbiter: frames read
//! go to the actor in order (pings are answered, and pongs timed, on the way); frames sent are
//! written in batches, everything queued since the last write going out in one flush (a step's
//! tokens and handoffs leave together).

use std::sync::Arc;
use std::time::Duration;

use actix::{Message, Recipient};
use futures_util::{SinkExt, StreamExt};
use tokio::sync::mpsc::{unbounded_channel, UnboundedSender};
use tokio::task::JoinHandle;
use tokio_util::codec::Framed;

use super::codec::{Codec, LinkCounters};
use super::protocol::Frame;
use super::tls::Io;

/// How often a quiet side says it is alive.
pub const HEARTBEAT: Duration = Duration::from_millis(500);
/// Silence after which a link counts as lost (a peer whose host vanished closes nothing).
pub const LINK_TIMEOUT: Duration = Duration::from_secs(3);

/// A frame read from link `generation`, or why that link ended.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Incoming {
    pub generation: u64,
    pub frame: Result<Frame, String>,
}

pub struct Connection {
    out: UnboundedSender<Frame>,
    tasks: [JoinHandle<()>; 2],
    counters: Arc<LinkCounters>,
    /// Frames read before this link opened (the counters outlive links).
    frames_before: u64,
    /// How long the peer may stay silent before its first frame.
    first_within: Duration,
    pub generation: u64,
    pub peer: String,
}

impl Connection {
    /// Starts reading and writing `link` to `peer` (on the current arbiter), counting into `counters`;
    /// what is read, and the link's end, go to `to` tagged with `generation`. The peer's
    /// first frame may take `first_within` (a front starts its own models before it reads
    /// its links); later ones [`LINK_TIMEOUT`].
    pub fn open(
        link: Framed<Io, Codec<Frame>>,
        peer: String,
        generation: u64,
        to: Recipient<Incoming>,
        counters: Arc<LinkCounters>,
        first_within: Duration,
    ) -> Self {
        let frames_before = counters
            .frames_in
            .load(std::sync::atomic::Ordering::Relaxed);
        counters.heard();
        let link = link.map_codec(|_| Codec::counted(counters.clone()));
        let (mut sink, mut stream) = link.split();
        let (out, mut queued) = unbounded_channel();
        let (reader_to, answers, heard) = (to.clone(), out.clone(), counters.clone());
        let reader = actix::spawn(async move {
            let end = loop {
                let frame = match stream.next().await {
                    Some(Ok(frame)) => frame,
                    Some(Err(e)) => break e.to_string(),
                    None => break "the peer closed the connection".into(),
                };
                heard.heard();
                match frame {
                    Frame::Ping(t) => {
                        let _ = answers.send(Frame::Pong(t));
                    }
                    Frame::Pong(t) => heard.pong(t),
                    frame => reader_to.do_send(Incoming {
                        generation,
                        frame: Ok(frame),
                    }),
                }
            };
            reader_to.do_send(Incoming {
                generation,
                frame: Err(end),
            });
        });
        let writer = actix::spawn(async move {
            while let Some(frame) = queued.recv().await {
                let mut batch = sink.feed(frame).await;
                while let (Ok(()), Ok(frame)) = (&batch, queued.try_recv()) {
                    batch = sink.feed(frame).await;
                }
                if let Err(e) = batch.and(sink.flush().await) {
                    to.do_send(Incoming {
                        generation,
                        frame: Err(format!("writing: {e}")),
                    });
                    return;
                }
            }
        });
        Self {
            out,
            tasks: [reader, writer],
            counters,
            frames_before,
            first_within,
            generation,
            peer,
        }
    }

    pub fn send(&self, frame: Frame) {
        // A writer that stopped has reported why; the frame has nowhere to go.
        let _ = self.out.send(frame);
    }

    /// Whether the peer has been silent too long.
    pub fn silent(&self) -> bool {
        let heard = self
            .counters
            .frames_in
            .load(std::sync::atomic::Ordering::Relaxed);
        let limit = if heard == self.frames_before {
            self.first_within
        } else {
            LINK_TIMEOUT
        };
        self.counters.silence() > limit
    }

    /// The heartbeat: a ping the peer answers.
    pub fn ping(&self) {
        self.send(Frame::Ping(self.counters.now_us()));
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}
