//! The device behind the backend: opening a GPU (libraries, kernels, the stream, cuBLASLt),
//! its memory (buffers, the KV cache, the copy rate), and timing launches for the breakdown.

use std::collections::HashMap;
use std::sync::Mutex;

use candle_core::{DType, Tensor};
use cudarc::cublaslt::CudaBlasLT;
use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, DeviceRepr};

use super::{device_err, Cuda, DeviceRows, MAX_HEAD_DIM};
use crate::kernels::cuda as kernels;
use crate::model::config::ModelConfig;
use crate::model::error::{ModelError, Result};
use crate::model::kv_cache::{DeviceKv, KvCache, KvDtype, KvStore};
use crate::model::timing::{breakdown_on, KernelTime};

/// Makes the device's default memory pool keep what is freed instead of handing it back to
/// the driver at every synchronization: a forward pass allocates and frees its activations
/// and scratch on the stream, and each step ends in a synchronization (the logits' copy to
/// the host), so with the default threshold of zero every step would map its memory afresh.
fn keep_freed_memory(ctx: &CudaContext) -> Result<()> {
    use cudarc::driver::{result, sys};
    let keep = u64::MAX;
    // SAFETY: the pool is the device's own, alive as long as the context; the attribute is a
    // u64 byte count, as cuMemPoolSetAttribute reads it for this attribute.
    unsafe {
        let pool = result::device::get_default_mem_pool(ctx.cu_device()).map_err(device_err)?;
        result::mem_pool::set_attribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&keep) as *const u64 as *mut std::ffi::c_void,
        )
        .map_err(device_err)
    }
}

impl Cuda {
    /// Opens GPU `ordinal` and compiles (or reads from the cache) every kernel for it. Each
    /// missing piece is named: the driver, NVRTC, cuBLASLt, the device.
    pub fn open(ordinal: usize) -> Result<Self> {
        // SAFETY: each only tries to open its library.
        let (driver, blas) = unsafe {
            (
                cudarc::driver::sys::is_culib_present(),
                cudarc::cublaslt::sys::is_culib_present(),
            )
        };
        if !driver {
            return Err(ModelError::Device(format!(
                "cuda:{ordinal}: the NVIDIA driver library (libcuda.so.1) was not found: \
                 this machine has no usable GPU driver"
            )));
        }
        if !kernels::nvrtc_present() {
            return Err(ModelError::Device(format!(
                "cuda:{ordinal}: {}",
                kernels::KernelError::NoNvrtc
            )));
        }
        if !blas {
            return Err(ModelError::Device(format!(
                "cuda:{ordinal}: cuBLASLt (libcublasLt.so.13) was not found: install it \
                 (pip install nvidia-cublas==13.0.*) and put its lib folder on LD_LIBRARY_PATH"
            )));
        }
        let count = CudaContext::device_count().map_err(device_err)?;
        if ordinal >= count.max(0) as usize {
            return Err(ModelError::Device(format!(
                "cuda:{ordinal}: this machine has {count} GPU(s)"
            )));
        }
        let ctx = CudaContext::new(ordinal).map_err(device_err)?;
        let (major, minor) = ctx.compute_capability().map_err(device_err)?;
        let arch = (major * 10 + minor) as u32;
        let multiprocessors = ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
            .map_err(device_err)? as usize;
        // SAFETY: every buffer of this backend is allocated, used and freed on its one stream,
        // so the events cudarc would record to order streams are not needed.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(device_err)?;
        keep_freed_memory(&ctx)?;
        let mut functions = HashMap::new();
        for (file, names) in kernels::kernels() {
            let body = kernels::SOURCES
                .iter()
                .find(|(f, _)| *f == file)
                .map(|(_, b)| *b)
                .expect("every kernel file is a source");
            let cubin = kernels::cached_cubin(file, body, arch)
                .map_err(|e| ModelError::Device(e.to_string()))?;
            let module = ctx
                .load_module(cudarc::nvrtc::Ptx::from_binary(cubin))
                .map_err(device_err)?;
            for name in names {
                let f = module.load_function(&name).map_err(device_err)?;
                functions.insert(name, f);
            }
        }
        let blas = CudaBlasLT::new(stream.clone()).map_err(device_err)?;
        let workspace = stream.alloc_zeros::<u8>(32 << 20).map_err(device_err)?;
        Ok(Self {
            ctx,
            stream,
            functions,
            blas,
            workspace,
            algos: Mutex::default(),
            launches: Mutex::default(),
            arch,
            multiprocessors,
            recordings: Mutex::default(),
            eager: Default::default(),
            replays: Default::default(),
        })
    }

    /// The raw address of `buf`, for a kernel argument that may be null.
    pub(super) fn ptr<T>(&self, buf: &CudaSlice<T>) -> u64 {
        cudarc::driver::DevicePtr::device_ptr(buf, &self.stream).0
    }

    pub(super) fn f(&self, name: &str) -> &CudaFunction {
        &self.functions[name]
    }

    pub(super) fn upload<T: DeviceRepr>(&self, data: &[T]) -> Result<CudaSlice<T>> {
        self.stream.clone_htod(data).map_err(device_err)
    }

    /// `rows` rows of `width` values, not initialized: for outputs a kernel writes in full.
    pub(super) fn alloc(&self, rows: usize, width: usize) -> Result<DeviceRows> {
        Ok(DeviceRows {
            buf: self.uninit((rows * width).max(1))?,
            rows,
            width,
        })
    }

    /// `len` values on the stream, not initialized.
    pub(super) fn uninit<T: DeviceRepr>(&self, len: usize) -> Result<CudaSlice<T>> {
        // SAFETY: every caller passes the buffer to a kernel that writes all of it before
        // anything reads it (the parity test compares whole outputs with the CPU's).
        unsafe { self.stream.alloc::<T>(len) }.map_err(device_err)
    }

    /// A vector of `f32` values on the device.
    pub(super) fn vector(&self, t: &Tensor) -> Result<CudaSlice<f32>> {
        self.upload(&t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
    }

    /// A KV cache of `num_blocks` blocks for every layer of `config`, in device memory.
    pub fn kv_cache(
        &self,
        config: &ModelConfig,
        block_size: usize,
        num_blocks: usize,
        dtype: KvDtype,
    ) -> Result<KvCache> {
        if dtype != KvDtype::F16 {
            return Err(ModelError::Device(
                "the CUDA backend stores its KV cache in f16 (kv_dtype = \"f16\")".into(),
            ));
        }
        if config.head_dim > MAX_HEAD_DIM {
            return Err(ModelError::Device(format!(
                "the CUDA attention kernel takes head_dim up to {MAX_HEAD_DIM}, not {}",
                config.head_dim
            )));
        }
        let per_layer = (num_blocks * block_size * config.kv_dim()).max(1);
        let layer = || {
            self.stream
                .alloc_zeros::<u16>(per_layer)
                .map_err(device_err)
        };
        let mut k = Vec::with_capacity(config.num_layers);
        let mut v = Vec::with_capacity(config.num_layers);
        for _ in 0..config.num_layers {
            k.push(layer()?);
            v.push(layer()?);
        }
        let store = KvStore::Cuda(DeviceKv {
            k,
            v,
            block_size,
            num_kv_heads: config.num_kv_heads,
            head_dim: config.head_dim,
        });
        Ok(KvCache::from_store(block_size, num_blocks, store))
    }

    /// Bytes per second a device-to-device copy moves (each byte read once and written once,
    /// both counted), best of five copies of 1 GiB.
    pub fn copy_rate(&self) -> Result<f64> {
        let len = 1 << 30;
        let src = self.stream.alloc_zeros::<u8>(len).map_err(device_err)?;
        let mut dst = self.stream.alloc_zeros::<u8>(len).map_err(device_err)?;
        let mut best = 0f64;
        for _ in 0..5 {
            self.synchronize()?;
            let started = std::time::Instant::now();
            self.stream
                .memcpy_dtod(&src, &mut dst)
                .map_err(device_err)?;
            self.synchronize()?;
            best = best.max(2.0 * len as f64 / started.elapsed().as_secs_f64());
        }
        Ok(best)
    }

    /// Free and total device memory, in bytes, after handing back to the driver what the
    /// stream's memory pool keeps of freed memory (see [`keep_freed_memory`]).
    pub fn memory(&self) -> Result<(usize, usize)> {
        use cudarc::driver::result;
        self.synchronize()?;
        // SAFETY: the pool is the device's own, alive as long as the context; trimming only
        // releases memory no allocation holds.
        unsafe {
            let pool =
                result::device::get_default_mem_pool(self.ctx.cu_device()).map_err(device_err)?;
            result::mem_pool::trim_to(pool, 0).map_err(device_err)?;
        }
        self.ctx.mem_get_info().map_err(device_err)
    }

    /// Runs `launch` (one kernel or library call named `name`), between two timing events
    /// while the breakdown is on.
    pub(super) fn timed(&self, name: &str, launch: impl FnOnce() -> Result<()>) -> Result<()> {
        if !breakdown_on() {
            return launch();
        }
        let event = || {
            self.stream
                .record_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(device_err)
        };
        let start = event()?;
        launch()?;
        let end = event()?;
        self.launches
            .lock()
            .expect("no panic holds the lock")
            .push((name.to_string(), start, end));
        Ok(())
    }

    /// Device time per kernel since the last call, longest first (waits for the device).
    pub fn take_kernel_times(&self) -> Result<Vec<KernelTime>> {
        let launches = std::mem::take(&mut *self.launches.lock().expect("no panic holds the lock"));
        let mut times: Vec<KernelTime> = Vec::new();
        for (name, start, end) in launches {
            let secs = start.elapsed_ms(&end).map_err(device_err)? as f64 / 1e3;
            match times.iter_mut().find(|t| t.name == name) {
                Some(t) => {
                    t.secs += secs;
                    t.launches += 1;
                }
                None => times.push(KernelTime {
                    name,
                    secs,
                    launches: 1,
                }),
            }
        }
        times.sort_by(|a, b| b.secs.total_cmp(&a.secs));
        Ok(times)
    }

    /// Waits for everything launched so far.
    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(device_err)
    }
}
