//! Quantized safetensors checkpoints: which `quantization_config` schemes are served, the check
//! of every tensor such a checkpoint stores, and reading one projection in its stored format
//! ([`PackedRows`]). Served, weight-only:
//! - `quant_method: fp8` with `weight_block_size [128, 128]` (DeepSeek/GLM official, as
//!   transformers' FineGrainedFP8 writes it): `*.weight` float8_e4m3fn and `*.weight_scale_inv`
//!   per 128×128 block. Its activation scheme `dynamic` quantizes activations at run time in
//!   vLLM/transformers' GPU kernels; here activations stay f32 (the weights are the checkpoint's).
//! - compressed-tensors `pack-quantized`, symmetric int4 in groups of 32/64/128:
//!   `weight_packed` (int32 words of 8 nibbles), `weight_scale`, `weight_shape`;
//! - compressed-tensors `nvfp4-pack-quantized` with no activation quantization: `weight_packed`
//!   (uint8, two E2M1 codes), `weight_scale` (E4M3 per 16), `weight_global_scale`.
//!
//! Which projections are quantized is read from the tensors (transformers leaves FP8 weights
//! whose shape does not tile into 128×128 blocks in bf16; compressed-tensors skips its `ignore`
//! list); a projection the config says to leave alone but that is stored quantized is an error.
//! Anything else — another scheme, activation or KV-cache quantization, asymmetric zero points, an
//! unexpected quantization tensor — is refused at load with the scheme and the tensor.

use safetensors::Dtype as StDtype;
use serde_json::Value;

use super::quant::packed::{e4m3_is_nan, PackedFormat, PackedRows};
use super::{DType, ModelError, WeightSource};

/// A tensor as stored, whatever its element type (packed integers and FP8 included).
#[derive(Clone, Copy, Debug)]
pub struct RawTensor<'a> {
    pub dtype: StDtype,
    pub shape: &'a [usize],
    pub data: &'a [u8],
}

/// A served `quantization_config`.
#[derive(Clone, Debug, PartialEq)]
pub enum QuantScheme {
    /// `quant_method: fp8`, 128×128 blocks; the modules it leaves unconverted.
    Fp8Block { not_converted: Vec<String> },
    /// compressed-tensors, int4 or NVFP4; its `ignore` list.
    CompressedTensors { format: PackedFormat, ignore: Vec<String> },
}

/// Names of the tensors quantization schemes attach to a module (any scheme we know of), so a
/// checkpoint carrying one we do not read is refused instead of ignored.
const QUANT_PARAMS: [&str; 18] = [
    "weight_scale",
    "weight_scale_inv",
    "weight_packed",
    "weight_shape",
    "weight_global_scale",
    "weight_zero_point",
    "weight_g_idx",
    "input_scale",
    "input_global_scale",
    "input_zero_point",
    "output_scale",
    "k_scale",
    "v_scale",
    "activation_scale",
    "qweight",
    "qzeros",
    "scales",
    "g_idx",
];

fn is_float(d: StDtype) -> bool {
    matches!(d, StDtype::F32 | StDtype::F16 | StDtype::BF16)
}

fn text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

fn strings(v: Option<&Value>) -> Vec<String> {
    v.and_then(Value::as_array).map(|a| a.iter().map(text).collect()).unwrap_or_default()
}

impl QuantScheme {
    /// Read `config.json`'s `quantization_config`: `Ok(None)` when there is none, `Err(why)` when
    /// it is not a scheme served here.
    pub fn from_config(config: &Value) -> Result<Option<QuantScheme>, String> {
        let Some(q) = config.get("quantization_config") else { return Ok(None) };
        let field = |k: &str| q.get(k).filter(|v| !v.is_null());
        match field("quant_method").map(text).as_deref() {
            Some("fp8") => Self::fp8(q).map(Some),
            Some("compressed-tensors") => Self::compressed_tensors(q).map(Some),
            Some(other) => Err(format!("quant_method `{other}` is not served")),
            None => Err("no quant_method".into()),
        }
    }

    fn fp8(q: &Value) -> Result<QuantScheme, String> {
        let field = |k: &str| q.get(k).filter(|v| !v.is_null());
        let block: Option<Vec<u64>> =
            field("weight_block_size").and_then(Value::as_array).map(|a| a.iter().filter_map(Value::as_u64).collect());
        if block.as_deref() != Some(&[128, 128]) {
            return Err("only weight_block_size [128, 128] is served (per-tensor or other block FP8 is not)".into());
        }
        let one_of = |k: &str, allowed: &[&str]| match field(k).map(text) {
            Some(v) if !allowed.contains(&v.as_str()) => Err(format!("{k} `{v}` is not served (only {allowed:?})")),
            _ => Ok(()),
        };
        one_of("activation_scheme", &["dynamic"])?;
        one_of("fmt", &["e4m3"])?;
        one_of("scale_fmt", &["float"])?;
        one_of("expert_dtype", &["fp8"])?;
        if !strings(field("modules_to_convert")).is_empty() {
            return Err("modules_to_convert (FP8 embeddings) is not served".into());
        }
        let mut not_converted = strings(field("modules_to_not_convert"));
        not_converted.extend(strings(field("ignored_layers")));
        Ok(QuantScheme::Fp8Block { not_converted })
    }

    fn compressed_tensors(q: &Value) -> Result<QuantScheme, String> {
        let field = |k: &str| q.get(k).filter(|v| !v.is_null());
        if let Some(status) = field("quantization_status").map(text) {
            if status != "compressed" {
                return Err(format!("quantization_status `{status}` (only compressed checkpoints are served)"));
            }
        }
        // compressed-tensors writes `sparsity_config: {}` and `transform_config: {}` into every
        // checkpoint it saves; an empty object means none, like null.
        let empty = |v: &&Value| v.as_object().is_some_and(|o| o.is_empty());
        for k in ["kv_cache_scheme", "sparsity_config", "transform_config"] {
            if field(k).filter(|v| !empty(v)).is_some() {
                return Err(format!("{k} is not served"));
            }
        }
        let groups = field("config_groups").and_then(Value::as_object).ok_or("no config_groups")?;
        let [(name, group)] = groups.iter().collect::<Vec<_>>()[..] else {
            return Err(format!("{} config groups (one is served)", groups.len()));
        };
        for k in ["input_activations", "output_activations"] {
            if group.get(k).is_some_and(|v| !v.is_null()) {
                return Err(format!("{name}: {k} are quantized (activation quantization is not served)"));
            }
        }
        let w = group.get("weights").filter(|v| !v.is_null()).ok_or(format!("{name}: no weights"))?;
        let arg = |k: &str| w.get(k).filter(|v| !v.is_null()).map(text).unwrap_or_default();
        let format = group.get("format").filter(|v| !v.is_null()).or(field("format")).map(text).unwrap_or_default();
        let packed = match (format.as_str(), arg("type").as_str(), arg("num_bits").as_str()) {
            ("pack-quantized", "int", "4") => {
                let group_size = w.get("group_size").and_then(Value::as_u64).unwrap_or(0) as usize;
                if arg("strategy") != "group" || ![32, 64, 128].contains(&group_size) {
                    return Err(format!(
                        "{name}: int4 strategy `{}` group {group_size} (groups of 32, 64 or 128 are served)",
                        arg("strategy")
                    ));
                }
                PackedFormat::Int4 { group: group_size }
            }
            ("nvfp4-pack-quantized", "float", "4") => {
                if arg("strategy") != "tensor_group" || arg("group_size") != "16" {
                    return Err(format!("{name}: NVFP4 strategy `{}` group {}", arg("strategy"), arg("group_size")));
                }
                PackedFormat::Nvfp4
            }
            (f, t, b) => return Err(format!("{name}: format `{f}` with {t} {b}-bit weights is not served")),
        };
        if arg("symmetric") != "true" {
            return Err(format!("{name}: asymmetric weights (zero points) are not served"));
        }
        if arg("dynamic") == "true" {
            return Err(format!("{name}: dynamic weight scales are not served"));
        }
        Ok(QuantScheme::CompressedTensors { format: packed, ignore: strings(field("ignore")) })
    }

    /// The format its quantized projections have.
    pub fn format(&self) -> PackedFormat {
        match self {
            QuantScheme::Fp8Block { .. } => PackedFormat::Fp8Block,
            QuantScheme::CompressedTensors { format, .. } => *format,
        }
    }

    /// `Err(why)` unless a tensor called `name` of type `dtype` is one this scheme stores (or a
    /// plain float tensor).
    pub fn check_tensor(&self, name: &str, dtype: StDtype) -> Result<(), String> {
        let param = name.rsplit('.').next().unwrap_or(name);
        let fp8 = StDtype::F8_E4M3;
        let ok = match (self, param) {
            (QuantScheme::Fp8Block { .. }, "weight") => is_float(dtype) || dtype == fp8,
            (QuantScheme::Fp8Block { .. }, "weight_scale_inv") => is_float(dtype),
            (QuantScheme::CompressedTensors { format, .. }, p) => match (format, p) {
                (PackedFormat::Int4 { .. }, "weight_packed") => dtype == StDtype::I32,
                (PackedFormat::Int4 { .. }, "weight_scale") => is_float(dtype),
                (PackedFormat::Int4 { .. }, "weight_shape") => matches!(dtype, StDtype::I64 | StDtype::I32),
                (PackedFormat::Nvfp4, "weight_packed") => dtype == StDtype::U8,
                (PackedFormat::Nvfp4, "weight_scale") => dtype == fp8,
                (PackedFormat::Nvfp4, "weight_global_scale") => dtype == StDtype::F32,
                (_, p) => is_float(dtype) && !QUANT_PARAMS.contains(&p),
            },
            (_, p) => is_float(dtype) && !QUANT_PARAMS.contains(&p),
        };
        if ok {
            Ok(())
        } else if QUANT_PARAMS.contains(&param) {
            Err(format!("`{param}` ({dtype:?}) is not part of this scheme (activation, KV-cache or zero-point quantization is not served)"))
        } else {
            Err(format!("a {dtype:?} tensor is not part of this scheme"))
        }
    }

    /// Whether module `base` is on the scheme's list of modules left in full precision. `re:`
    /// patterns are not evaluated (what is stored decides; this list only catches contradictions).
    fn leaves_alone(&self, base: &str) -> bool {
        let list = match self {
            QuantScheme::Fp8Block { not_converted } => not_converted,
            QuantScheme::CompressedTensors { ignore, .. } => ignore,
        };
        list.iter().filter(|p| !p.starts_with("re:") && !p.is_empty()).any(|p| {
            base == p
                || base.ends_with(&format!(".{p}"))
                || base.starts_with(&format!("{p}."))
                || base.contains(&format!(".{p}."))
        })
    }
}

fn bad(w: &dyn WeightSource, name: &str, msg: String) -> ModelError {
    ModelError::Format { file: w.file_of(name), msg: format!("tensor `{name}`: {msg}") }
}

fn raw<'a>(w: &'a dyn WeightSource, name: &str) -> Result<RawTensor<'a>, ModelError> {
    w.raw_tensor(name).ok_or_else(|| ModelError::MissingTensor { file: w.file_of(name), tensor: name.to_string() })
}

fn expect_shape(w: &dyn WeightSource, name: &str, t: &RawTensor<'_>, shape: &[usize]) -> Result<(), ModelError> {
    if t.shape != shape {
        return Err(ModelError::ShapeMismatch {
            file: w.file_of(name),
            tensor: name.to_string(),
            expected: shape.to_vec(),
            found: t.shape.to_vec(),
        });
    }
    Ok(())
}

/// A float tensor's values as f32 (exact widening).
fn floats(w: &dyn WeightSource, name: &str, t: &RawTensor<'_>) -> Result<Vec<f32>, ModelError> {
    let dtype = match t.dtype {
        StDtype::F32 => DType::F32,
        StDtype::F16 => DType::F16,
        StDtype::BF16 => DType::BF16,
        other => return Err(bad(w, name, format!("scale stored as {other:?}, expected F32, F16 or BF16"))),
    };
    let mut out = vec![0f32; t.shape.iter().product()];
    super::quant::dequantize_into(dtype, t.data, &mut out);
    Ok(out)
}

fn refuse_nan_codes(w: &dyn WeightSource, name: &str, bytes: &[u8]) -> Result<(), ModelError> {
    match bytes.iter().position(|&b| e4m3_is_nan(b)) {
        Some(i) => Err(bad(w, name, format!("element {i} is an FP8 NaN code"))),
        None => Ok(()),
    }
}

/// The tensors a projection `base` of `w`'s scheme may be stored as (for loaders that account
/// for every tensor they read).
pub fn linear_tensor_names(base: &str) -> [String; 6] {
    ["weight", "weight_scale_inv", "weight_packed", "weight_scale", "weight_shape", "weight_global_scale"]
        .map(|p| format!("{base}.{p}"))
}

/// Projection `base` (`[out, inp]`) in its stored quantized format, or `Ok(None)` when `w`
/// declares no scheme or stores this projection as plain floats (`{base}.weight`, which the
/// caller then reads as usual).
pub fn load_linear(w: &dyn WeightSource, base: &str, out: usize, inp: usize) -> Result<Option<PackedRows>, ModelError> {
    let Some(scheme) = w.quantization() else { return Ok(None) };
    let format = scheme.format();
    let weight = format!("{base}.weight");
    let quantized = match scheme {
        QuantScheme::Fp8Block { .. } => w.raw_tensor(&weight).is_some_and(|t| t.dtype == StDtype::F8_E4M3),
        QuantScheme::CompressedTensors { .. } => w.raw_tensor(&format!("{base}.weight_packed")).is_some(),
    };
    if !quantized {
        for extra in &linear_tensor_names(base)[1..] {
            if w.raw_tensor(extra).is_some() {
                return Err(bad(w, extra, format!("a quantization tensor of `{base}`, whose weight is not quantized")));
            }
        }
        return Ok(None);
    }
    if scheme.leaves_alone(base) {
        return Err(bad(
            w,
            &weight,
            format!("the quantization_config leaves `{base}` unquantized, but it is stored as {}", format.name()),
        ));
    }
    let group = format.group();
    if !inp.is_multiple_of(group) {
        return Err(bad(w, &weight, format!("{inp} input columns are not a whole number of {}-column groups", group)));
    }
    let groups = inp / group;
    let mut p = PackedRows {
        format,
        rows: out,
        cols: inp,
        codes: Vec::new(),
        scales: Vec::new(),
        scale_codes: Vec::new(),
        row_global: Vec::new(),
    };
    match format {
        PackedFormat::Fp8Block => {
            let t = raw(w, &weight)?;
            expect_shape(w, &weight, &t, &[out, inp])?;
            refuse_nan_codes(w, &weight, t.data)?;
            let sname = format!("{base}.weight_scale_inv");
            let s = raw(w, &sname)?;
            let block_rows = out.div_ceil(128);
            expect_shape(w, &sname, &s, &[block_rows, groups])?;
            let grid = floats(w, &sname, &s)?;
            p.codes = t.data.to_vec();
            p.scales = (0..out).flat_map(|r| grid[r / 128 * groups..(r / 128 + 1) * groups].iter().copied()).collect();
        }
        PackedFormat::Int4 { .. } => {
            let pname = format!("{base}.weight_packed");
            let t = raw(w, &pname)?;
            expect_shape(w, &pname, &t, &[out, inp / 8])?;
            let shape_name = format!("{base}.weight_shape");
            let st = raw(w, &shape_name)?;
            let dims: Vec<i64> = match st.dtype {
                StDtype::I64 => st.data.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect(),
                _ => st.data.chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().unwrap()) as i64).collect(),
            };
            if dims != [out as i64, inp as i64] {
                return Err(bad(w, &shape_name, format!("holds {dims:?}, expected [{out}, {inp}]")));
            }
            let sname = format!("{base}.weight_scale");
            let s = raw(w, &sname)?;
            expect_shape(w, &sname, &s, &[out, groups])?;
            p.scales = floats(w, &sname, &s)?;
            // The int32 words' little-endian bytes are the nibble stream, element 2k in the low
            // nibble of byte k: kept as they are.
            p.codes = t.data.to_vec();
        }
        PackedFormat::Nvfp4 => {
            let pname = format!("{base}.weight_packed");
            let t = raw(w, &pname)?;
            expect_shape(w, &pname, &t, &[out, inp / 2])?;
            let sname = format!("{base}.weight_scale");
            let s = raw(w, &sname)?;
            expect_shape(w, &sname, &s, &[out, groups])?;
            refuse_nan_codes(w, &sname, s.data)?;
            let gname = format!("{base}.weight_global_scale");
            let g = raw(w, &gname)?;
            let gv = floats(w, &gname, &g)?;
            let [global] = gv[..] else {
                return Err(bad(w, &gname, format!("has {} elements, expected 1", gv.len())));
            };
            if !(global.is_finite() && global > 0.0) {
                return Err(bad(w, &gname, format!("global scale {global} is not a positive number")));
            }
            p.codes = t.data.to_vec();
            p.scale_codes = s.data.to_vec();
            p.row_global = vec![global; out];
        }
    }
    Ok(Some(p))
}

/// Projection `base` as f32 rows, dequantized with the tool's arithmetic when it is stored
/// quantized: for the few matrices a backend consumes in a derived form rather than as a
/// projection (MLA's `kv_b_proj`, absorbed per head, as vLLM also dequantizes it).
pub fn load_matrix_f32(w: &dyn WeightSource, base: &str, out: usize, inp: usize) -> Result<Vec<f32>, ModelError> {
    if let Some(p) = load_linear(w, base, out, inp)? {
        tracing::info!(tensor = base, format = %p.format.name(), "dequantized to f32 for absorption");
        return Ok(p.dequantize());
    }
    let t = w.expect(&format!("{base}.weight"), &[out, inp])?;
    Ok(super::tensor::to_f32(&t))
}
