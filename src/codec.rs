//! The protobuf codec of intray's own services and clients: prost, with a
//! small initial buffer.
//!
//! tonic gives every call an encode buffer of 8 KiB up front and keeps it for
//! the life of a streaming response. intray's messages are mostly far
//! smaller, and a server holding ten thousand `WatchJob` streams would spend
//! 80 MiB on buffers that stay empty. Buffers still grow to any message.

use std::marker::PhantomData;

use prost::Message;
use tonic::codec::{BufferSettings, Codec};
use tonic_prost::{ProstCodec, ProstDecoder, ProstEncoder};

/// Initial size of a call's encode and decode buffers.
const BUFFER_SIZE: usize = 512;
/// tonic's default: how much an encoder buffers before yielding.
const YIELD_THRESHOLD: usize = 32 * 1024;

/// [`ProstCodec`] with [`BUFFER_SIZE`] buffers; named in `build.rs`.
#[derive(Debug, Clone, Copy)]
pub struct LeanCodec<T, U>(PhantomData<(T, U)>);

impl<T, U> Default for LeanCodec<T, U> {
    fn default() -> Self {
        LeanCodec(PhantomData)
    }
}

fn settings() -> BufferSettings {
    BufferSettings::new(BUFFER_SIZE, YIELD_THRESHOLD)
}

impl<T, U> Codec for LeanCodec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = ProstDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ProstCodec::<T, U>::raw_encoder(settings())
    }

    fn decoder(&mut self) -> Self::Decoder {
        ProstCodec::<T, U>::raw_decoder(settings())
    }
}
