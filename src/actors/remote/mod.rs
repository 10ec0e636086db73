//! Model actors in other processes: a subserver hosts one model actor and serves the
//! inter-actor protocol over TCP; the front server reaches it through a stand-in actor that
//! takes the messages a local model actor takes. The messages are the in-process ones, as
//! length-prefixed bincode frames ([`protocol`]); a link opens only between peers that prove a
//! shared secret ([`handshake`]) and that serve one vocabulary and one routing setup.
//!
//! Topology: the front server is the hub. Its request actors own every request; a subserver's
//! token events and handoffs go back to the front, which delivers them (to a request actor, to
//! a local model, or on to another subserver).

pub mod connection;
pub mod front_link;
pub mod handshake;
pub mod protocol;
pub mod remote_model;
