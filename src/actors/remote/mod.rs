//! Model actors in other processes: a subserver hosts one model actor and serves the
//! inter-actor protocol over TCP; the front server reaches it through a stand-in actor that
//! takes the messages a local model actor takes. The messages are the in-process ones, as
//! length-prefixed bincode frames ([`protocol`]); a link opens only between peers that prove a
//! shared secret ([`handshake`]) or, over TLS, hold certificates of a common CA ([`tls`]), and
//! that serve one vocabulary and one routing setup.
//!
//! Topology: the front server is the hub. Its request actors own every request; a subserver's
//! token events and handoffs go back to the front, which delivers them (to a request actor, to
//! a local model, or on to another subserver).

pub mod codec;
pub mod connection;
pub mod front_link;
pub mod handshake;
pub mod protocol;
pub mod remote_model;
pub mod tls;
pub mod vocabulary;

use std::sync::OnceLock;

/// The runtime that drives the links a front opens while it starts (on a thread of its own,
/// as its start is not async): they stay registered with it, and the actors that take them
/// over read and write them from their own threads.
pub fn link_runtime() -> &'static tokio::runtime::Runtime {
    static RUNTIME: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RUNTIME.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("link-io")
            .enable_all()
            .build()
            .expect("an I/O runtime starts")
    })
}
