//! What a handoff costs on a link besides the network: encoding its frame (length prefix and
//! bincode) and decoding and checking it on the other side, for a handoff carrying a 256- and
//! a 2048-token sequence, and for one token event (the frame each committed token sends).

use bytes::BytesMut;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use tokenrouter::actors::messages::TokenEvent;
use tokenrouter::actors::remote::codec::Codec;
use tokenrouter::actors::remote::protocol::{
    Bounds, Frame, WireBody, WireHandoff, WireMeta, WirePeer,
};
use tokenrouter::model::SamplingParams;
use tokenrouter::routing::Speculation;
use tokio_util::codec::{Decoder, Encoder};

fn handoff(tokens: usize) -> Frame {
    Frame::Peer(WirePeer {
        from: 0,
        to: 1,
        active_delta: 1,
        route_prob: None,
        body: WireBody::Handoff(WireHandoff {
            meta: WireMeta {
                id: 42,
                prompt_len: tokens / 2,
                params: SamplingParams::greedy(),
                max_tokens: tokens,
                stop_ids: vec![151_643, 151_645],
                home: 0,
            },
            tokens: (0..tokens as u32).map(|i| i * 7919 % 151_000).collect(),
            carried: None,
            drafts: 0,
            dists: Vec::new(),
            speculation: Speculation::default(),
        }),
    })
}

/// A frame's name and how to make it.
type Case = (&'static str, fn() -> Frame);

fn round_trip(c: &mut Criterion) {
    let bounds = Bounds {
        num_models: 2,
        vocab_size: 151_936,
        max_len: 32_768,
    };
    let mut group = c.benchmark_group("frame_encode_decode_validate");
    let token = || Frame::Event {
        id: 42,
        event: TokenEvent::Token {
            token: 1234,
            model: 1,
        },
    };
    let cases: [Case; 3] = [
        ("token_event", token),
        ("handoff_256", || handoff(256)),
        ("handoff_2048", || handoff(2048)),
    ];
    for (name, make) in cases {
        let mut codec = Codec::<Frame>::default();
        let mut buf = BytesMut::with_capacity(1 << 16);
        group.bench_with_input(BenchmarkId::from_parameter(name), &name, |b, _| {
            b.iter_batched(
                &make,
                |frame| {
                    codec.encode(frame, &mut buf).unwrap();
                    let back = codec.decode(&mut buf).unwrap().unwrap();
                    back.validate(bounds).unwrap();
                    back
                },
                criterion::BatchSize::SmallInput,
            )
        });
    }
    group.finish();
}

criterion_group!(benches, round_trip);
criterion_main!(benches);
