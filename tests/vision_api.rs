//! Images end to end on the smallest chat checkpoint with a vision tower
//! (`tests/fixtures/glm5/vision-chat`, made by `scripts/gen_glm5_vision_chat.py`; its tower is the
//! one `media_golden` checks against transformers):
//! - the official `openai` and `anthropic` Python clients against the real binary: a data-URL
//!   image (and a base64 image block, and a `file://` image inside `--allowed-local-media-path`)
//!   gives exactly the text the engine's own `generate --image` path gives for the same prompt
//!   ids, with the image tokens counted in usage; too many images, undecodable bytes, a remote URL
//!   and a file outside the allowed directory are 400s in each API's error shape
//!   (`tests/openai/test_vision_clients.py`);
//! - the prefix cache keyed by images, in process: the same image and text hit (pages across the
//!   image, the KDA state resumed from their snapshots) with a reply equal bit for bit to the first,
//!   which equals the one-sequence `Runner` path; a different image with the same token ids never
//!   hits the pages it touches, and its reply equals a fresh engine's.
//!
//! Python is `$SHELFSERVE_PYTHON` or `python3`; without `openai` and `anthropic` the client test
//! is skipped with a reason locally and fails under CI.

mod binary_server;
mod common;
mod e2e_http;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use binary_server::{python, python_has, Server};
use serde_json::{json, Value};
use shelfserve::actors::{Engine, EngineOptions, InferenceEngine, PromptImage, StreamEvent, Usage};
use shelfserve::backend::cpu::glm5_next::Glm5Backend;
use shelfserve::backend::KvGeometry;
use shelfserve::config::engine::EngineConfig;
use shelfserve::generate::{DeviceSelection, Runner};
use shelfserve::media::{content_hash, decode_image, DecodeLimits, ImageProcessor, ProcessedImage};
use shelfserve::model::default_model::CacheDir;
use shelfserve::model::glm5_next::read_config;
use shelfserve::model::ModelBundle;

const MODEL: &str = "glm5-vision";
const MAX_TOKENS: usize = 10;
/// `<|image|>` in the fixture's tokenizer (its config's `image_token_id`).
const IMAGE_TOKEN: u32 = 503;

fn fixture_dir() -> PathBuf {
    common::fixture("glm5/vision-chat")
}

fn image_path() -> PathBuf {
    common::fixture("media/exact.png")
}

// ---------------------------------------------------------------- the official clients

#[test]
fn official_clients_send_images_to_the_real_binary() {
    if !python_has(&["openai", "anthropic"]) {
        assert!(std::env::var_os("CI").is_none(), "the python client packages are missing under CI");
        eprintln!("skipped: `{}` cannot import openai and anthropic", python());
        return;
    }
    let allowed = tempfile::tempdir().expect("temp dir");
    let elsewhere = tempfile::tempdir().expect("temp dir");
    let outside = elsewhere.path().join("outside.png");
    std::fs::copy(image_path(), &outside).expect("copy the image");
    let server = Server::start(
        &fixture_dir(),
        MODEL,
        &["--allowed-local-media-path", allowed.path().to_str().expect("utf-8 path"), "--max-images-per-request", "2"],
        "vision",
    );
    // The server's own prompt ids for the conversation (placeholders expanded)...
    let b64 = base64_of(&std::fs::read(image_path()).expect("read the image"));
    let messages = json!([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{b64}")}},
        {"type": "text", "text": "What is in the picture?"},
    ]}]);
    let r = server
        .target("voice")
        .post("/tokenize", &json!({"messages": messages, "chat_template_kwargs": {"enable_thinking": false}}))
        .expect("/tokenize");
    assert_eq!(r.status, 200, "{}", r.text());
    let ids: Vec<u64> = r.json()["tokens"].as_array().expect("tokens").iter().filter_map(Value::as_u64).collect();
    let image_tokens = ids.iter().filter(|&&t| t == IMAGE_TOKEN as u64).count();
    assert_eq!(image_tokens, processed(&image_path()).tokens(2), "one placeholder per merged patch group");
    // ... and the text the engine's one-sequence path (`generate --image`) makes of them.
    let ids_arg = ids.iter().map(u64::to_string).collect::<Vec<_>>().join(",");
    let out = Command::new(env!("CARGO_BIN_EXE_shelfserve"))
        .args(["generate", "--device", "cpu", "--model"])
        .arg(fixture_dir())
        .args(["--input-ids", &ids_arg, "--max-tokens", &MAX_TOKENS.to_string(), "--image"])
        .arg(image_path())
        .output()
        .expect("run shelfserve generate");
    assert!(out.status.success(), "generate failed: {}", String::from_utf8_lossy(&out.stderr));
    let expected = String::from_utf8(out.stdout).expect("utf-8").trim_end_matches('\n').to_owned();
    assert!(!expected.trim().is_empty(), "generate produced no text to compare with");

    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/openai/test_vision_clients.py");
    let out = Command::new(python())
        .arg(&script)
        .arg(format!("http://{}", server.addr("voice")))
        .args(["--model", MODEL, "--image"])
        .arg(image_path())
        .arg("--allowed-dir")
        .arg(allowed.path())
        .arg("--outside")
        .arg(&outside)
        .args(["--expected-text", &expected, "--prompt-tokens", &ids.len().to_string()])
        .args(["--max-tokens", &MAX_TOKENS.to_string()])
        .output()
        .expect("run the python script");
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!("{stdout}{}", String::from_utf8_lossy(&out.stderr));
    let last = stdout.lines().last().unwrap_or("");
    assert!(out.status.success() && last.ends_with(" 0 failed"), "vision client checks failed: {last}");
    let r = server.target("voice").get("/health").expect("/health");
    assert_eq!(r.status, 200, "still serving after every error case: {}", r.text());
}

fn base64_of(bytes: &[u8]) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

// ---------------------------------------------------------------- prefix cache keyed by images

const BLOCK: usize = 4;
const PAGE: usize = 8;

fn open_fixture() -> ModelBundle {
    shelfserve::model::open(fixture_dir().to_str().expect("utf-8"), &CacheDir::from_env()).expect("open the fixture")
}

fn processor() -> ImageProcessor {
    ImageProcessor::from_dir(&fixture_dir()).expect("processor settings")
}

fn processed(path: &Path) -> ProcessedImage {
    let img = decode_image(&std::fs::read(path).expect("read"), DecodeLimits::default()).expect("decode");
    processor().process(&img).expect("process")
}

/// The same picture with one pixel changed: the same grid and token count, another image.
fn altered(path: &Path) -> ProcessedImage {
    let mut img = decode_image(&std::fs::read(path).expect("read"), DecodeLimits::default()).expect("decode");
    img.data[0] = img.data[0].wrapping_add(128);
    processor().process(&img).expect("process")
}

/// 9 text tokens (page 0 is text only), the image's placeholders (pages 1-3), 6 text tokens.
fn prompt_with(image: &ProcessedImage) -> (Vec<u32>, PromptImage) {
    let n = image.tokens(2);
    let mut ids: Vec<u32> = (0..9).map(|i| 20 + i * 13).collect();
    let start = ids.len();
    ids.extend(std::iter::repeat_n(IMAGE_TOKEN, n));
    ids.extend((0..6).map(|i| 30 + i * 17));
    let image = PromptImage {
        span: start..start + n,
        grid: image.grid,
        pixel_values: Arc::from(image.pixel_values.clone()),
        hash: content_hash(image),
    };
    (ids, image)
}

async fn engine() -> Arc<Engine> {
    let mut cfg = EngineConfig::builtin();
    cfg.scheduler.block_size = BLOCK;
    cfg.scheduler.page_tokens = PAGE;
    cfg.scheduler.kv_pool_tokens = 512;
    // Prefill chunks of one page: the image's rows arrive in three steps.
    cfg.scheduler.max_num_batched_tokens = PAGE;
    cfg.scheduler.max_num_seqs = 4;
    common::engine::set_spill(&mut cfg, None);
    let opts =
        EngineOptions { device: DeviceSelection { threads: 2, ..Default::default() }, served_model_name: "t".into() };
    common::engine::start_ready(open_fixture(), cfg, opts, Duration::from_secs(60)).await
}

/// Greedy ids and each one's log-probability bits (equal replies agree bit for bit).
async fn run(e: &Engine, prompt: &[u32], image: &PromptImage) -> (Vec<(u32, u32)>, Usage) {
    let mut req = common::greedy_request(prompt.to_vec(), MAX_TOKENS);
    req.sampling.logprobs = Some(0);
    req.images = vec![image.clone()];
    let mut rx = e.submit(req).expect("submit");
    let mut out = Vec::new();
    loop {
        match tokio::time::timeout(Duration::from_secs(120), rx.recv()).await.expect("no event in 120 s") {
            Some(StreamEvent::Delta { tokens, .. }) => {
                out.extend(tokens.iter().map(|t| (t.id, t.logprob.expect("logprobs").to_bits())))
            }
            Some(StreamEvent::Finished { usage, .. }) => return (out, usage),
            Some(StreamEvent::Error(err)) => panic!("request failed: {err}"),
            None => panic!("stream ended without Finished"),
        }
    }
}

/// The one-sequence path (`generate --image`): ids only.
fn runner_ids(prompt: &[u32], image: &ProcessedImage) -> Vec<u32> {
    let bundle = open_fixture();
    let cfg = read_config(bundle.weights.origin()).expect("config");
    let geom = KvGeometry { block_size: BLOCK, num_blocks: 64, state_slots: 1 };
    let backend = Glm5Backend::new(cfg, bundle.weights.as_ref(), 2, geom).expect("backend");
    let opts = common::greedy_options(MAX_TOKENS, 5);
    let out = Runner::new(backend)
        .generate_with_images(prompt, std::slice::from_ref(image), &opts, None, |_| true)
        .expect("generate");
    out.tokens.iter().map(|s| s.token).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_prefix_cache_hits_the_same_image_and_never_a_different_one() {
    let x = processed(&image_path());
    let y = altered(&image_path());
    assert_eq!(x.grid, y.grid);
    assert_ne!(content_hash(&x), content_hash(&y));
    let (ids, img_x) = prompt_with(&x);
    let (ids_y, img_y) = prompt_with(&y);
    assert_eq!(ids, ids_y, "identical token ids");
    let eligible_pages = (ids.len() - 1) / PAGE;

    let e = engine().await;
    let (first, usage) = run(&e, &ids, &img_x).await;
    assert_eq!(usage.cached_tokens, 0);
    assert_eq!(usage.prompt_tokens, ids.len(), "image tokens count as prompt tokens");
    let plain: Vec<u32> = first.iter().map(|t| t.0).collect();
    assert_eq!(plain, runner_ids(&ids, &x), "the engine equals the one-sequence path");

    // The same image and text: every whole page before the last token hits, across the image.
    let (again, usage) = run(&e, &ids, &img_x).await;
    assert_eq!(usage.cached_tokens, eligible_pages * PAGE, "pages across the image hit");
    assert_eq!(again, first, "a resumed request equals the fresh one, bit for bit");

    // A different image at the same positions: only the text-only page 0 hits.
    let (other, usage) = run(&e, &ids, &img_y).await;
    assert_eq!(usage.cached_tokens, PAGE, "no page the image touches is shared");
    assert_ne!(other, first, "the image changes the reply");
    e.shutdown();

    let fresh = engine().await;
    let (alone, usage) = run(&fresh, &ids, &img_y).await;
    assert_eq!(usage.cached_tokens, 0);
    assert_eq!(alone, other, "the other image's reply equals a fresh engine's");
    fresh.shutdown();
}
