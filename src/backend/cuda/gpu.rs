//! The device layer under the CUDA backend: one context and stream, raw device buffers with RAII,
//! NVRTC-compiled kernel modules (compiled once per backend for the device's compute capability
//! and cached by module name), typed launches, and cuBLAS GEMMs. Knows nothing of models.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::cublas::sys as cublas_sys;
use cudarc::cublas::CudaBlas;
use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{result as drv, CudaContext, CudaFunction, CudaModule, CudaStream, LaunchConfig};

use super::kernel_cache::{KernelCache, ModuleSource};
use crate::backend::BackendError;

/// Kernel sources, embedded so the binary needs no files at run time.
const COMMON: &str = include_str!("../../../cuda/common.cuh");
pub const MODULES: &[(&str, &str)] = &[
    ("llama", include_str!("../../../cuda/llama.cu")),
    ("attention", include_str!("../../../cuda/attention.cu")),
    ("attention_mma", include_str!("../../../cuda/attention_mma.cu")),
    ("sampling", include_str!("../../../cuda/sampling.cu")),
];
/// The fused decode GEMVs: compiled per backend for its storage type only ([`Gpu::load_gemv`]).
pub const GEMV_SOURCE: &str = include_str!("../../../cuda/gemv.cu");
/// `glm5_next`'s layer kernels: compiled only by backends of that model ([`Gpu::load_glm5`]).
pub const GLM5_SOURCE: &str = include_str!("../../../cuda/glm5.cu");
/// `glm5_next`'s tensor-core MLA attention (bf16), compiled with [`GLM5_SOURCE`].
pub const GLM5_MLA_SOURCE: &str = include_str!("../../../cuda/glm5_mla.cu");
/// Grouped tensor-core expert GEMMs of large `glm5_next` steps.
pub const GLM5_MOE_SOURCE: &str = include_str!("../../../cuda/glm5_moe.cu");
/// `glm5_next`'s vision tower kernels: compiled only by backends of a model with a tower (or
/// one given image embeddings) ([`Gpu::load_vision`]).
pub const VISION_SOURCE: &str = include_str!("../../../cuda/vision.cu");
/// Packed quantized linears (FP8, int4, NVFP4): compiled only by backends whose checkpoint has
/// them ([`Gpu::load_quant`]).
pub const QUANT_SOURCE: &str = include_str!("../../../cuda/quant_gemv.cu");
/// The DFlash block drafter's kernels: compiled only when a drafter runs on the device
/// ([`Gpu::load_dflash`]).
pub const DFLASH_SOURCE: &str = include_str!("../../../cuda/dflash.cu");

fn gemv_module(p: Precision) -> &'static str {
    match p {
        Precision::Bf16 => "gemv_bf16",
        Precision::F32 => "gemv_f32",
    }
}

pub fn dev_err(what: &str, e: impl std::fmt::Debug) -> BackendError {
    BackendError::Device(format!("{what}: {e:?}"))
}

/// Storage precision of weights, KV cache and GEMM inputs. The residual stream and GEMM
/// accumulation are f32 in both.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precision {
    Bf16,
    /// Everything f32 (cuBLAS in pedantic f32): the tight validation mode.
    F32,
}

impl Precision {
    pub fn bytes(self) -> usize {
        match self {
            Precision::Bf16 => 2,
            Precision::F32 => 4,
        }
    }

    /// Kernel name suffix.
    pub fn suffix(self) -> &'static str {
        match self {
            Precision::Bf16 => "bf16",
            Precision::F32 => "f32",
        }
    }

    fn cuda_type(self) -> cublas_sys::cudaDataType {
        match self {
            Precision::Bf16 => cublas_sys::cudaDataType::CUDA_R_16BF,
            Precision::F32 => cublas_sys::cudaDataType::CUDA_R_32F,
        }
    }
}

/// Whether the CUDA driver, NVRTC and cuBLAS libraries can be loaded, and how many devices the
/// driver sees. `Err` says why CUDA is not usable.
pub fn device_count() -> Result<usize, String> {
    // SAFETY: these only try to open the shared libraries.
    let libs = unsafe {
        [
            ("driver (libcuda)", cudarc::driver::sys::is_culib_present()),
            ("NVRTC (libnvrtc)", cudarc::nvrtc::sys::is_culib_present()),
            ("cuBLAS (libcublas)", cudarc::cublas::sys::is_culib_present()),
        ]
    };
    if let Some((name, _)) = libs.iter().find(|(_, ok)| !ok) {
        return Err(format!("the CUDA {name} library was not found"));
    }
    drv::init().map_err(|e| format!("cuInit failed: {e:?}"))?;
    let n = drv::device::get_count().map_err(|e| format!("counting devices failed: {e:?}"))?;
    Ok(n.max(0) as usize)
}

/// Free and total bytes of device `ordinal`.
pub fn device_memory(ordinal: usize) -> Result<(usize, usize), BackendError> {
    device_count().map_err(|reason| BackendError::Unavailable { device: format!("cuda:{ordinal}"), reason })?;
    let ctx = CudaContext::new(ordinal).map_err(|e| dev_err("creating the context", e))?;
    ctx.mem_get_info().map_err(|e| dev_err("reading free memory", e))
}

/// Compile one kernel module (with the shared header prepended) to PTX for `sm_{major}{minor}`.
pub fn compile_module(
    module: &str,
    src: &str,
    arch: (i32, i32),
    defines: &[String],
) -> Result<cudarc::nvrtc::Ptx, BackendError> {
    // The same options the engine's CUBIN builds use, so this check compiles what serving runs.
    let options = super::kernel_cache::nvrtc_options(arch, defines);
    let opts = cudarc::nvrtc::CompileOptions { options, name: Some(format!("{module}.cu")), ..Default::default() };
    cudarc::nvrtc::compile_ptx_with_opts(format!("{COMMON}\n{src}"), opts)
        .map_err(|e| BackendError::Device(format!("NVRTC failed on cuda/{module}.cu: {e}")))
}

/// Macro definitions for every kernel module, from `SHELFSERVE_CUDA_DEFINES` (`NAME=VALUE` or
/// `NAME`, separated by `,` or `+`): the kernels' compile-time switches (e.g. `GEMV_R1_BLOCKS_ROPE=2`), so a
/// variant can be compared with the default in one run without a rebuild.
pub fn parse_kernel_defines(value: &str) -> Result<Vec<String>, BackendError> {
    let bad = || BackendError::Device(format!("SHELFSERVE_CUDA_DEFINES={value:?}: expected NAME[=VALUE],..."));
    let word = |s: &str, first_alpha: bool| {
        !s.is_empty()
            && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || (!first_alpha && c == '.'))
            && !(first_alpha && s.starts_with(|c: char| c.is_ascii_digit()))
    };
    value
        .split([',', '+'])
        .map(|d| {
            let (name, val) = d.trim().split_once('=').map_or((d.trim(), None), |(n, v)| (n, Some(v)));
            let ok = word(name, true) && val.is_none_or(|v| word(v, false));
            ok.then(|| d.trim().to_string()).ok_or_else(bad)
        })
        .collect()
}

/// A device allocation, freed on drop.
pub struct DevBuf {
    ptr: CUdeviceptr,
    bytes: usize,
    ctx: Arc<CudaContext>,
}

impl DevBuf {
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Address `offset` bytes in.
    pub fn at(&self, offset: usize) -> u64 {
        debug_assert!(offset <= self.bytes);
        self.ptr + offset as u64
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        if self.bytes > 0 && self.ctx.bind_to_thread().is_ok() {
            // SAFETY: `ptr` came from `malloc_sync` in this context and is freed once.
            let _ = unsafe { drv::free_sync(self.ptr) };
        }
    }
}

/// Most token rows a step may have to run on the fused decode GEMVs (`cuda/gemv.cu`, compiled
/// for up to 4 rows). Measured on the H200 (8B shapes, session 2's skinny kernel): at 8 rows
/// a GEMV re-reads the activations once per row and loses to cuBLAS (16.3 ms/step at batch 8
/// vs 13.3 ms for cuBLAS at batch 32), so steps of more than 4 rows go to cuBLAS. Session 5:
/// 3-4 rows (7.5 ms/step at batch 4) are slower than cuBLAS at batch 8 (6.3 ms), but they keep
/// a row's result independent of the batch (`concurrent = solo` bitwise), which cuBLAS does not.
pub const GEMV_MAX_ROWS: usize = 4;

/// Launch dimensions.
pub fn cfg(grid: (u32, u32), block: u32, smem: u32) -> LaunchConfig {
    LaunchConfig { grid_dim: (grid.0.max(1), grid.1.max(1), 1), block_dim: (block, 1, 1), shared_mem_bytes: smem }
}

/// Launch dimensions with a three-dimensional grid.
pub fn cfg3(grid: (u32, u32, u32), block: u32, smem: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid.0.max(1), grid.1.max(1), grid.2.max(1)),
        block_dim: (block, 1, 1),
        shared_mem_bytes: smem,
    }
}

/// Grid size for a grid-stride loop over `n` elements.
pub fn grid_for(n: usize, block: u32) -> u32 {
    (n.div_ceil(block as usize)).clamp(1, 65_535) as u32
}

/// How the kernels that support it are launched; read once when the device opens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchTuning {
    /// Launch the kernels that wait on their predecessor (`pdl_wait` in cuda/common.cuh) as
    /// programmatic dependents, so each starts loading its weights while the previous kernel
    /// drains (sm_90 and later; `SHELFSERVE_CUDA_PDL=0` turns it off).
    pub dependent_launch: bool,
}

impl LaunchTuning {
    /// The tuning for a device of compute capability `cc`, from the environment's values (`var`
    /// looks one up by name).
    pub fn parse(cc: (i32, i32), var: impl Fn(&str) -> Option<String>) -> Result<Self, BackendError> {
        let allowed = match var("SHELFSERVE_CUDA_PDL").as_deref() {
            None | Some("1") => true,
            Some("0") => false,
            Some(other) => return Err(BackendError::Device(format!("SHELFSERVE_CUDA_PDL={other:?}: expected 0 or 1"))),
        };
        Ok(LaunchTuning { dependent_launch: allowed && cc.0 >= 9 })
    }

    fn from_env(cc: (i32, i32)) -> Result<Self, BackendError> {
        Self::parse(cc, |name| std::env::var(name).ok())
    }
}

/// A kernel parameter as the driver takes it: the address of the value.
pub fn kernel_param<T: DeviceRepr>(value: &T) -> *mut std::ffi::c_void {
    value as *const T as *mut std::ffi::c_void
}

pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    blas: CudaBlas,
    /// Side streams with a cuBLAS handle each, made on first use (`ensure_side_lanes`): lane
    /// `i + 1` of `gemm_on`. Work on them is ordered against `stream` by `fork_lanes` and
    /// `join_lanes` only.
    side: Vec<(Arc<CudaStream>, CudaBlas)>,
    modules: HashMap<&'static str, Arc<CudaModule>>,
    functions: HashMap<String, CudaFunction>,
    pub name: String,
    pub ordinal: usize,
    pub compute_capability: (i32, i32),
    pub tuning: LaunchTuning,
    /// `SHELFSERVE_CUDA_DEFINES`, passed to NVRTC for every module.
    kernel_defines: Vec<String>,
    kernels: KernelCache,
}

impl Gpu {
    /// Open device `ordinal` and compile every kernel module for its architecture.
    pub fn open(ordinal: usize) -> Result<Self, BackendError> {
        let count =
            device_count().map_err(|reason| BackendError::Unavailable { device: format!("cuda:{ordinal}"), reason })?;
        if ordinal >= count {
            return Err(BackendError::Unavailable {
                device: format!("cuda:{ordinal}"),
                reason: format!("the driver sees {count} device(s)"),
            });
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| dev_err("creating the context", e))?;
        // We order all work ourselves and pass raw pointers to kernels: one stream, plus side
        // lanes whose work is fenced against it by explicit events (`fork_lanes`/`join_lanes`).
        // SAFETY: no buffer is handed to cudarc's tracked types across streams.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(|e| dev_err("creating a stream", e))?;
        let blas = CudaBlas::new(stream.clone()).map_err(|e| dev_err("creating the cuBLAS handle", e))?;
        let compute_capability = ctx.compute_capability().map_err(|e| dev_err("reading compute capability", e))?;
        let name = ctx.name().unwrap_or_else(|_| "unknown".into());
        let tuning = LaunchTuning::from_env(compute_capability)?;
        let kernel_defines = match std::env::var("SHELFSERVE_CUDA_DEFINES") {
            Ok(v) if !v.is_empty() => parse_kernel_defines(&v)?,
            _ => Vec::new(),
        };
        if !kernel_defines.is_empty() {
            tracing::info!(defines = kernel_defines.join(","), "kernel modules compiled with extra definitions");
        }
        let mut gpu = Gpu {
            ctx,
            stream,
            blas,
            side: Vec::new(),
            modules: HashMap::new(),
            functions: HashMap::new(),
            name,
            ordinal,
            compute_capability,
            tuning,
            kernel_defines,
            kernels: KernelCache::from_env(),
        };
        // Both storage types of the GEMVs compile beside the rest (a first start waits for the
        // slowest module, not the sum); `load_gemv` picks one.
        let mut sources: Vec<(&'static str, String)> = MODULES.iter().map(|(m, src)| (*m, src.to_string())).collect();
        for p in [Precision::Bf16, Precision::F32] {
            sources.push((gemv_module(p), format!("#define GEMV_STORAGE_{}\n{GEMV_SOURCE}", p.suffix())));
        }
        gpu.compile_all(&sources)?;
        Ok(gpu)
    }

    /// Compile the decode GEMV module (`cuda/gemv.cu`) for storage precision `prec` alone.
    pub fn load_gemv(&mut self, prec: Precision) -> Result<(), BackendError> {
        let m = self.modules.get(gemv_module(prec)).cloned();
        match m {
            Some(m) => {
                self.modules.insert("gemv", m);
                Ok(())
            }
            None => self.compile("gemv", &format!("#define GEMV_STORAGE_{}\n{GEMV_SOURCE}", prec.suffix())),
        }
    }

    /// Compile `glm5_next`'s kernel modules (`cuda/glm5.cu`, `cuda/glm5_mla.cu`, `cuda/glm5_moe.cu`).
    pub fn load_glm5(&mut self) -> Result<(), BackendError> {
        self.compile_all(&[
            ("glm5", GLM5_SOURCE.to_string()),
            ("glm5_mla", GLM5_MLA_SOURCE.to_string()),
            ("glm5_moe", GLM5_MOE_SOURCE.to_string()),
        ])
    }

    /// Compile the vision tower's kernel module (`cuda/vision.cu`) once.
    pub fn load_vision(&mut self) -> Result<(), BackendError> {
        if self.modules.contains_key("vision") {
            return Ok(());
        }
        self.compile("vision", VISION_SOURCE)
    }

    /// Compile the packed quantized kernels (`cuda/quant_gemv.cu`) once.
    pub fn load_quant(&mut self) -> Result<(), BackendError> {
        if self.modules.contains_key("quant") {
            return Ok(());
        }
        self.compile("quant", QUANT_SOURCE)
    }

    /// Compile the DFlash drafter's kernels (`cuda/dflash.cu`) once.
    pub fn load_dflash(&mut self) -> Result<(), BackendError> {
        if self.modules.contains_key("dflash") {
            return Ok(());
        }
        self.compile("dflash", DFLASH_SOURCE)
    }

    fn compile(&mut self, module: &'static str, src: &str) -> Result<(), BackendError> {
        self.compile_all(&[(module, src.to_string())])
    }

    /// Build `modules` (sources without the shared header) as CUBINs, in parallel and through
    /// the disk cache, and load them into the context. A cached module the driver refuses is
    /// compiled again.
    fn compile_all(&mut self, modules: &[(&'static str, String)]) -> Result<(), BackendError> {
        let started = std::time::Instant::now();
        let sources: Vec<ModuleSource<'_>> =
            modules.iter().map(|(name, src)| ModuleSource { name, source: format!("{COMMON}\n{src}") }).collect();
        let cubins = self.kernels.cubins(&sources, self.compute_capability, &self.kernel_defines)?;
        for ((name, _), (source, cubin)) in modules.iter().zip(sources.iter().zip(cubins)) {
            let m = match self.ctx.load_module(cudarc::nvrtc::Ptx::from_binary(cubin)) {
                Ok(m) => m,
                Err(e) => {
                    tracing::warn!(module = name, error = ?e, "cached kernel module refused; compiling it again");
                    self.kernels.evict(source, self.compute_capability, &self.kernel_defines);
                    let fresh = KernelCache::disabled().cubins(
                        std::slice::from_ref(source),
                        self.compute_capability,
                        &self.kernel_defines,
                    )?;
                    let cubin = fresh.into_iter().next().unwrap_or_default();
                    self.ctx
                        .load_module(cudarc::nvrtc::Ptx::from_binary(cubin))
                        .map_err(|e| dev_err(&format!("loading module {name}"), e))?
                }
            };
            self.modules.insert(name, m);
        }
        let names: Vec<&str> = modules.iter().map(|(n, _)| *n).collect();
        tracing::info!(modules = names.join(","), ms = started.elapsed().as_millis() as u64, "kernel modules ready");
        Ok(())
    }

    /// A kernel by name, looked up once and cached.
    pub fn func(&mut self, module: &'static str, name: &str) -> Result<CudaFunction, BackendError> {
        if let Some(f) = self.functions.get(name) {
            return Ok(f.clone());
        }
        let m = self.modules.get(module).ok_or_else(|| BackendError::Device(format!("no kernel module {module}")))?;
        let f = m.load_function(name).map_err(|e| dev_err(&format!("kernel {name}"), e))?;
        self.functions.insert(name.to_string(), f.clone());
        Ok(f)
    }

    /// Launch `f` with `params` (each the address of one argument, in the kernel's order). A
    /// `dependent` launch may start while the previous kernel on the stream drains when the
    /// tuning allows it; only kernels that call `pdl_wait()` before touching their
    /// predecessors' outputs may be launched so.
    ///
    /// # Safety
    /// `params` must match `f`'s parameter list and point at live values.
    pub unsafe fn launch_params(
        &self,
        f: &CudaFunction,
        cfg: LaunchConfig,
        params: &mut [*mut std::ffi::c_void],
        dependent: bool,
    ) -> Result<(), BackendError> {
        use cudarc::driver::sys;
        self.bind()?;
        let stream = self.stream.cu_stream();
        let (grid, block) = (cfg.grid_dim, cfg.block_dim);
        if !(dependent && self.tuning.dependent_launch) {
            return drv::launch_kernel(f.cu_function(), grid, block, cfg.shared_mem_bytes, stream, params)
                .map_err(|e| dev_err("kernel launch", e));
        }
        // SAFETY: a zeroed attribute is a valid value of the C struct; its id and value are set next.
        let mut attr: sys::CUlaunchAttribute = std::mem::zeroed();
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let config = sys::CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: grid.2,
            blockDimX: block.0,
            blockDimY: block.1,
            blockDimZ: block.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: stream,
            attrs: &mut attr,
            numAttrs: 1,
        };
        sys::cuLaunchKernelEx(&config, f.cu_function(), params.as_mut_ptr(), std::ptr::null_mut())
            .result()
            .map_err(|e| dev_err("dependent kernel launch", e))
    }

    pub fn bind(&self) -> Result<(), BackendError> {
        self.ctx.bind_to_thread().map_err(|e| dev_err("binding the context", e))
    }

    pub fn alloc(&self, bytes: usize) -> Result<DevBuf, BackendError> {
        self.bind()?;
        let ptr = if bytes == 0 {
            0
        } else {
            // SAFETY: plain device allocation; freed by `DevBuf::drop`.
            unsafe { drv::malloc_sync(bytes) }
                .map_err(|e| dev_err(&format!("allocating {:.1} MiB", bytes as f64 / 1048576.0), e))?
        };
        Ok(DevBuf { ptr, bytes, ctx: self.ctx.clone() })
    }

    /// Allocate and fill from the host.
    pub fn upload<T: Copy>(&self, data: &[T]) -> Result<DevBuf, BackendError> {
        let b = self.alloc(std::mem::size_of_val(data))?;
        self.copy_htod(b.ptr(), data)?;
        Ok(b)
    }

    pub fn copy_htod<T: Copy>(&self, dst: u64, data: &[T]) -> Result<(), BackendError> {
        if data.is_empty() {
            return Ok(());
        }
        // Waits for the transfer, so a failed copy is reported here, not by a later call.
        self.copy_htod_in_order(dst, data)?;
        self.sync()
    }

    /// Host→device copy of a step's small inputs, without waiting for it: `data` is ordinary
    /// (pageable) host memory, which the driver has copied into its own staging buffer by the
    /// time the call returns, so `data` may go; the transfer runs in stream order before
    /// anything launched after it. Saves a round trip between decode steps.
    pub fn copy_htod_in_order<T: Copy>(&self, dst: u64, data: &[T]) -> Result<(), BackendError> {
        if data.is_empty() {
            return Ok(());
        }
        // SAFETY: `dst` points to at least `size_of_val(data)` bytes (callers size buffers);
        // `data` is pageable (a Rust slice never registered with the driver), so the call
        // returns only after the driver has staged it.
        unsafe { drv::memcpy_htod_async(dst, data, self.stream.cu_stream()) }
            .map_err(|e| dev_err("host→device copy", e))
    }

    pub fn copy_dtoh<T: Copy>(&self, dst: &mut [T], src: u64) -> Result<(), BackendError> {
        if dst.is_empty() {
            return Ok(());
        }
        // SAFETY: as above; synchronised before `dst` is read.
        unsafe {
            drv::memcpy_dtoh_async(dst, src, self.stream.cu_stream()).map_err(|e| dev_err("device→host copy", e))?;
        }
        self.sync()
    }

    pub fn copy_dtod(&self, dst: u64, src: u64, bytes: usize) -> Result<(), BackendError> {
        // SAFETY: both ranges are `bytes` long inside live allocations (callers check).
        unsafe { drv::memcpy_dtod_async(dst, src, bytes, self.stream.cu_stream()) }
            .map_err(|e| dev_err("device→device copy", e))
    }

    /// Zero `bytes` at `dst`, in stream order.
    pub fn zero(&self, dst: u64, bytes: usize) -> Result<(), BackendError> {
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: `dst` points to at least `bytes` bytes of a live allocation (callers size it).
        unsafe { drv::memset_d8_async(dst, 0, bytes, self.stream.cu_stream()) }.map_err(|e| dev_err("device memset", e))
    }

    pub fn sync(&self) -> Result<(), BackendError> {
        self.stream.synchronize().map_err(|e| dev_err("stream synchronize", e))
    }

    /// `y[m, n] (+)= x[m, k] · w[n, k]ᵀ` with row-major `x` (`prec`), row-major `w` (`prec`) and
    /// f32 `y`, accumulating in f32. `accumulate` adds into `y` (fused residual add).
    #[allow(clippy::too_many_arguments)]
    pub fn gemm(
        &self,
        prec: Precision,
        m: usize,
        n: usize,
        k: usize,
        x: u64,
        w: u64,
        y: u64,
        accumulate: bool,
    ) -> Result<(), BackendError> {
        self.gemm_ld(prec, m, n, k, x, w, y, n, accumulate)
    }

    /// [`gemm`](Self::gemm) into rows of `ldy` f32 (`y` may point into a wider output: one part
    /// of a row-stacked projection).
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_ld(
        &self,
        prec: Precision,
        m: usize,
        n: usize,
        k: usize,
        x: u64,
        w: u64,
        y: u64,
        ldy: usize,
        accumulate: bool,
    ) -> Result<(), BackendError> {
        self.gemm_with(&self.blas, prec, (m, n, k), (x, w, y), ldy, accumulate)
    }

    /// Make `count` side lanes (streams with a cuBLAS handle each) if fewer exist.
    pub fn ensure_side_lanes(&mut self, count: usize) -> Result<(), BackendError> {
        while self.side.len() < count {
            let stream = self.stream.fork().map_err(|e| dev_err("creating a side stream", e))?;
            let blas = CudaBlas::new(stream.clone()).map_err(|e| dev_err("creating a side cuBLAS handle", e))?;
            self.side.push((stream, blas));
        }
        Ok(())
    }

    /// The side lanes start after the work queued so far on the main stream.
    pub fn fork_lanes(&self) -> Result<(), BackendError> {
        for (side, _) in &self.side {
            side.join(&self.stream).map_err(|e| dev_err("fencing a side stream", e))?;
        }
        Ok(())
    }

    /// The main stream continues after the work queued so far on every side lane.
    pub fn join_lanes(&self) -> Result<(), BackendError> {
        for (side, _) in &self.side {
            self.stream.join(side).map_err(|e| dev_err("joining a side stream", e))?;
        }
        Ok(())
    }

    /// [`gemm`](Self::gemm) on lane `lane`: 0 is the main stream, `i + 1` side lane `i` (made by
    /// `ensure_side_lanes`; between `fork_lanes` and `join_lanes`).
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_on(
        &self,
        lane: usize,
        prec: Precision,
        m: usize,
        n: usize,
        k: usize,
        x: u64,
        w: u64,
        y: u64,
    ) -> Result<(), BackendError> {
        let blas = match lane {
            0 => &self.blas,
            i => &self.side.get(i - 1).ok_or_else(|| BackendError::Device(format!("no side lane {i}")))?.1,
        };
        self.gemm_with(blas, prec, (m, n, k), (x, w, y), n, false)
    }

    fn gemm_with(
        &self,
        blas: &CudaBlas,
        prec: Precision,
        (m, n, k): (usize, usize, usize),
        (x, w, y): (u64, u64, u64),
        ldy: usize,
        accumulate: bool,
    ) -> Result<(), BackendError> {
        if m == 0 || n == 0 {
            return Ok(());
        }
        let (alpha, beta) = (1.0f32, if accumulate { 1.0f32 } else { 0.0 });
        let compute = match prec {
            Precision::Bf16 => cublas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            Precision::F32 => cublas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_PEDANTIC,
        };
        let dt = prec.cuda_type();
        // Column-major view: yᵀ[n, m] = w[n, k] (wᵀ stored col-major, so op T) · xᵀ[k, m].
        // SAFETY: pointers are live device buffers of the stated shapes (callers size them).
        unsafe {
            cudarc::cublas::result::gemm_ex(
                *blas.handle(),
                cublas_sys::cublasOperation_t::CUBLAS_OP_T,
                cublas_sys::cublasOperation_t::CUBLAS_OP_N,
                n as i32,
                m as i32,
                k as i32,
                &alpha as *const f32 as *const _,
                w as *const _,
                dt,
                k as i32,
                x as *const _,
                dt,
                k as i32,
                &beta as *const f32 as *const _,
                y as *mut _,
                cublas_sys::cudaDataType::CUDA_R_32F,
                ldy as i32,
                compute,
                cublas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| dev_err(&format!("cuBLAS GEMM {m}×{n}×{k} ({prec:?}, output row stride {ldy})"), e))
    }
}

/// One operand of a strided batched GEMM in cuBLAS's column-major view: batch `i` starts
/// `stride · i` elements after `ptr`, columns `ld` elements apart.
#[derive(Clone, Copy, Debug)]
pub struct Strided {
    pub ptr: u64,
    pub ld: usize,
    pub stride: usize,
}

impl Gpu {
    /// `batch` bf16 GEMMs with f32 accumulation, column-major: `C_i[m, n] = op(A_i) · B_i[k, n]`,
    /// `op` the transpose when `transpose_a` (A stored `[k, m]`), else A stored `[m, k]`. C is
    /// bf16 when `c_bf16`, else f32.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_batched_bf16(
        &self,
        transpose_a: bool,
        (m, n, k): (usize, usize, usize),
        a: Strided,
        b: Strided,
        c: Strided,
        c_bf16: bool,
        batch: usize,
    ) -> Result<(), BackendError> {
        if m == 0 || n == 0 || batch == 0 {
            return Ok(());
        }
        let (alpha, beta) = (1.0f32, 0.0f32);
        let bf16 = cublas_sys::cudaDataType::CUDA_R_16BF;
        let c_type = if c_bf16 { bf16 } else { cublas_sys::cudaDataType::CUDA_R_32F };
        let op_a = if transpose_a {
            cublas_sys::cublasOperation_t::CUBLAS_OP_T
        } else {
            cublas_sys::cublasOperation_t::CUBLAS_OP_N
        };
        // SAFETY: the callers pass live device buffers holding `batch` operands of these shapes.
        unsafe {
            cudarc::cublas::result::gemm_strided_batched_ex(
                *self.blas.handle(),
                op_a,
                cublas_sys::cublasOperation_t::CUBLAS_OP_N,
                m as i32,
                n as i32,
                k as i32,
                &alpha as *const f32 as *const _,
                a.ptr as *const _,
                bf16,
                a.ld as i32,
                a.stride as i64,
                b.ptr as *const _,
                bf16,
                b.ld as i32,
                b.stride as i64,
                &beta as *const f32 as *const _,
                c.ptr as *mut _,
                c_type,
                c.ld as i32,
                c.stride as i64,
                batch as i32,
                cublas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| dev_err(&format!("cuBLAS batched GEMM {batch}×{m}×{n}×{k}"), e))
    }
}

/// Launch `f` with the given arguments (each pushed by reference).
#[macro_export]
macro_rules! launch {
    ($gpu:expr, $f:expr, $cfg:expr, $($arg:expr),+ $(,)?) => {{
        use cudarc::driver::PushKernelArg as _;
        let f = $f;
        let mut b = $gpu.stream.launch_builder(&f);
        $( b.arg($arg); )+
        // SAFETY: every kernel's parameter list matches the arguments pushed here (see cuda/*.cu).
        let launch_cfg = $cfg;
        unsafe { b.launch(launch_cfg) }.map(|_| ()).map_err(|e| $crate::backend::cuda::gpu::dev_err("kernel launch", e))
    }};
}

pub use cudarc::driver::DeviceRepr;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn launch_tuning_defaults_by_architecture_and_refuses_bad_values() {
        fn with(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
            let pairs: Vec<(String, String)> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
            move |name| pairs.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone())
        }
        let hopper = LaunchTuning::parse((9, 0), with(&[])).unwrap();
        assert!(hopper.dependent_launch);
        assert!(!LaunchTuning::parse((8, 0), with(&[])).unwrap().dependent_launch, "griddepcontrol needs sm_90");
        assert!(!LaunchTuning::parse((8, 0), with(&[("SHELFSERVE_CUDA_PDL", "1")])).unwrap().dependent_launch);
        assert!(!LaunchTuning::parse((9, 0), with(&[("SHELFSERVE_CUDA_PDL", "0")])).unwrap().dependent_launch);
        for bad in ["yes", "2", ""] {
            let e = LaunchTuning::parse((9, 0), with(&[("SHELFSERVE_CUDA_PDL", bad)])).unwrap_err().to_string();
            assert!(e.contains("SHELFSERVE_CUDA_PDL"), "{e}");
        }
    }

    #[test]
    fn kernel_defines_are_names_with_optional_values() {
        assert_eq!(parse_kernel_defines("GEMV_PRELOAD=0").unwrap(), ["GEMV_PRELOAD=0"]);
        assert_eq!(parse_kernel_defines("A=1, B_2+C=0.5").unwrap(), ["A=1", "B_2", "C=0.5"]);
        for bad in ["", "A=", "1A", "A B", "A=1;B", "A,,B", "A=\"x\""] {
            let e = parse_kernel_defines(bad).unwrap_err().to_string();
            assert!(e.contains("SHELFSERVE_CUDA_DEFINES"), "{bad}: {e}");
        }
    }

    // No GPU needed, only the library: the NVIDIA wheels of a torch install ship it
    // (`site-packages/nvidia/cu13/lib`). gpu_validate.sh runs the integration tests, not this one.
    #[test]
    #[ignore = "needs libnvrtc, not a GPU: LD_LIBRARY_PATH=<its dir> cargo test --lib -- --ignored every_kernel"]
    fn every_kernel_module_compiles_for_hopper_and_ampere() {
        for cc in [(9, 0), (8, 0)] {
            for (module, src) in MODULES.iter().chain([
                &("gemv", GEMV_SOURCE),
                &("glm5", GLM5_SOURCE),
                &("glm5_mla", GLM5_MLA_SOURCE),
                &("glm5_moe", GLM5_MOE_SOURCE),
                &("vision", VISION_SOURCE),
                &("quant", QUANT_SOURCE),
            ]) {
                let ptx = compile_module(module, src, cc, &[]).unwrap_or_else(|e| panic!("{e}"));
                assert!(ptx.to_src().contains(".entry"), "{module}: no kernels in the PTX");
            }
        }
    }
}
