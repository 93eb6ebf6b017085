//! Video end to end on the smallest chat checkpoint with a vision tower
//! (`tests/fixtures/glm5/vision-chat`, whose template writes `<|begin_of_video|><|video|>
//! <|end_of_video|>` for a `video` part), and per-request isolation of media failures:
//! - the official `openai` client against the real binary (`tests/openai/test_video_clients.py`):
//!   a frame-list video (`{"type": "video", "video": [data URLs], "fps": N}`, and the same frames
//!   as `file://` paths) gives exactly the text the engine gives in process for the server's own
//!   prompt ids with the frame pairs made by `media::VideoProcessor`, video tokens counted in
//!   usage; the prompt ids hold, per frame pair, `<|begin_of_image|>`, the pair's placeholders,
//!   `<|end_of_image|>` and its timestamp, as transformers' processor writes them; a bad video is
//!   a 400 while concurrent good requests succeed; frames, videos, sizes, containers without the
//!   `video-ffmpeg` feature and remote frames are 400s naming their limit or rule;
//! - in process: a sequence whose image fails to encode in the vision tower fails alone (400
//!   class) while a good request in the same steps runs to the same reply as alone; under tensor
//!   parallelism images are refused up front with a message naming `--tp`.
//!
//! Python is `$SHELFSERVE_PYTHON` or `python3`; without `openai` the client test is skipped with
//! a reason locally and fails under CI.

mod binary_server;
mod common;
mod e2e_http;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use binary_server::{python, python_has, Server};
use serde_json::{json, Value};
use shelfserve::actors::{Engine, EngineError, EngineOptions, InferenceEngine, PromptImage, StreamEvent};
use shelfserve::config::engine::EngineConfig;
use shelfserve::generate::DeviceSelection;
use shelfserve::media::{
    content_hash, decode_image, frame_labels, DecodeLimits, ImageProcessor, ProcessedImage, VideoProcessor,
};
use shelfserve::model::default_model::CacheDir;
use shelfserve::model::ModelBundle;

const MODEL: &str = "glm5-vision";
const MAX_TOKENS: usize = 10;
/// The fixture's `<|begin_of_image|>`, `<|image|>`, `<|end_of_image|>` (config.json).
const IMAGE_START: u32 = 502;
const IMAGE_TOKEN: u32 = 503;
const IMAGE_END: u32 = 504;
const FPS: f64 = 2.0;

fn fixture_dir() -> PathBuf {
    common::fixture("glm5/vision-chat")
}

/// 8 frames of 56×56: 4 frame pairs of 2×2 merged groups (4 placeholders each), no resize.
fn frame_paths() -> Vec<PathBuf> {
    (0..8).map(|k| common::fixture(&format!("media/video/aligned_{k}.png"))).collect()
}

fn frame_pairs() -> Vec<ProcessedImage> {
    let frames: Vec<_> = frame_paths()
        .iter()
        .map(|p| decode_image(&std::fs::read(p).expect("read"), DecodeLimits::default()).expect("decode"))
        .collect();
    let video = VideoProcessor::from_dir(&fixture_dir()).expect("settings").process(&frames).expect("process");
    assert_eq!(video.grid, [4, 4, 4]);
    video.frames()
}

fn open_fixture() -> ModelBundle {
    shelfserve::model::open(fixture_dir().to_str().expect("utf-8"), &CacheDir::from_env()).expect("open the fixture")
}

async fn engine(tensor_parallel: usize) -> Arc<Engine> {
    let mut cfg = EngineConfig::builtin();
    cfg.scheduler.block_size = 4;
    cfg.scheduler.page_tokens = 8;
    cfg.scheduler.kv_pool_tokens = 1024;
    cfg.scheduler.max_num_batched_tokens = 64;
    cfg.scheduler.max_num_seqs = 4;
    common::engine::set_spill(&mut cfg, None);
    let device = DeviceSelection { threads: 2, tensor_parallel, ..Default::default() };
    let opts = EngineOptions { device, served_model_name: MODEL.into() };
    common::engine::start_ready(open_fixture(), cfg, opts, Duration::from_secs(120)).await
}

fn prompt_image(span: std::ops::Range<usize>, img: &ProcessedImage) -> PromptImage {
    PromptImage { span, grid: img.grid, pixel_values: Arc::from(img.pixel_values.clone()), hash: content_hash(img) }
}

/// A request's reply text (the server's detokenization: special tokens skipped, stopping at the
/// model's end-of-generation ids), or its error.
async fn reply(e: &Engine, prompt: Vec<u32>, images: Vec<PromptImage>) -> Result<String, EngineError> {
    let mut req = common::greedy_request(prompt, MAX_TOKENS);
    req.ignore_eos = false;
    req.images = images;
    let mut rx = e.submit(req)?;
    let mut text = String::new();
    loop {
        match tokio::time::timeout(Duration::from_secs(120), rx.recv()).await.expect("no event in 120 s") {
            Some(StreamEvent::Delta { text: t, .. }) => text.push_str(&t),
            Some(StreamEvent::Finished { .. }) => return Ok(text),
            Some(StreamEvent::Error(err)) => return Err(err),
            None => panic!("stream ended without Finished"),
        }
    }
}

// ---------------------------------------------------------------- the official client

#[test]
fn the_official_client_sends_a_frame_list_video_to_the_real_binary() {
    if !python_has(&["openai"]) {
        assert!(std::env::var_os("CI").is_none(), "the python client package is missing under CI");
        eprintln!("skipped: `{}` cannot import openai", python());
        return;
    }
    let allowed = tempfile::tempdir().expect("temp dir");
    let server = Server::start(
        &fixture_dir(),
        MODEL,
        &[
            "--allowed-local-media-path",
            allowed.path().to_str().expect("utf-8 path"),
            "--max-video-frames",
            "8",
            "--max-videos-per-request",
            "1",
        ],
        "video",
    );
    use base64::Engine as _;
    let urls: Vec<String> = frame_paths()
        .iter()
        .map(|p| {
            let b64 = base64::engine::general_purpose::STANDARD.encode(std::fs::read(p).expect("read"));
            format!("data:image/png;base64,{b64}")
        })
        .collect();
    let messages = json!([{"role": "user", "content": [
        {"type": "video", "video": urls, "fps": FPS},
        {"type": "text", "text": "What happens in the video?"},
    ]}]);
    let r = server
        .target("voice")
        .post("/tokenize", &json!({"messages": messages, "chat_template_kwargs": {"enable_thinking": false}}))
        .expect("/tokenize");
    assert_eq!(r.status, 200, "{}", r.text());
    let ids: Vec<u32> =
        r.json()["tokens"].as_array().expect("tokens").iter().filter_map(Value::as_u64).map(|t| t as u32).collect();

    // The video as transformers writes it: per frame pair, the image markers around its
    // placeholders, then its timestamp text.
    let pairs = frame_pairs();
    let bundle = open_fixture();
    let tok = bundle.tokenizer.as_ref().expect("tokenizer");
    let labels = frame_labels(&(0..8).collect::<Vec<_>>(), FPS, pairs.len());
    let mut want = Vec::new();
    for label in &labels {
        want.push(IMAGE_START);
        want.extend(std::iter::repeat_n(IMAGE_TOKEN, 4));
        want.push(IMAGE_END);
        want.extend(tok.encode(label, false).expect("encode"));
    }
    let start = ids.iter().position(|&t| t == IMAGE_START).expect("a frame marker");
    assert_eq!(ids[start..start + want.len()], want[..], "the video's ids");
    assert_eq!(labels, ["0.0 seconds", "1.0 seconds", "2.0 seconds", "3.0 seconds"]);

    // The engine in process on those ids, each frame pair on its run of placeholders.
    let mut spans: Vec<std::ops::Range<usize>> = Vec::new();
    for (i, &t) in ids.iter().enumerate() {
        if t == IMAGE_TOKEN {
            match spans.last_mut() {
                Some(s) if s.end == i => s.end = i + 1,
                _ => spans.push(i..i + 1),
            }
        }
    }
    assert_eq!(spans.len(), pairs.len());
    let images: Vec<PromptImage> = spans.into_iter().zip(&pairs).map(|(s, p)| prompt_image(s, p)).collect();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let expected = rt.block_on(async {
        let e = engine(1).await;
        let text = reply(&e, ids.clone(), images).await.expect("the engine's reply");
        e.shutdown();
        text
    });
    assert!(!expected.trim().is_empty(), "the engine produced no text to compare with");

    let other = common::fixture("media/video/tenths_0.png");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/openai/test_video_clients.py");
    let out = Command::new(python())
        .arg(&script)
        .arg(format!("http://{}", server.addr("voice")))
        .args(["--model", MODEL, "--frames"])
        .args(frame_paths())
        .arg("--other-size")
        .arg(other)
        .args(["--fps", &FPS.to_string(), "--allowed-dir"])
        .arg(allowed.path())
        .args(["--expected-text", &expected, "--prompt-tokens", &ids.len().to_string()])
        .args(["--max-tokens", &MAX_TOKENS.to_string()])
        .output()
        .expect("run the python script");
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!("{stdout}{}", String::from_utf8_lossy(&out.stderr));
    let last = stdout.lines().last().unwrap_or("");
    assert!(out.status.success() && last.ends_with(" 0 failed"), "video client checks failed: {last}");
    let r = server.target("voice").get("/health").expect("/health");
    assert_eq!(r.status, 200, "still serving after every error case: {}", r.text());
}

// ---------------------------------------------------------------- isolation and refusal

fn image() -> ProcessedImage {
    let img = decode_image(&std::fs::read(common::fixture("media/exact.png")).expect("read"), DecodeLimits::default())
        .expect("decode");
    ImageProcessor::from_dir(&fixture_dir()).expect("settings").process(&img).expect("process")
}

/// 5 text tokens, the image's placeholders, 3 text tokens.
fn prompt_with(img: &ProcessedImage) -> (Vec<u32>, std::ops::Range<usize>) {
    let mut ids: Vec<u32> = (0..5).map(|i| 20 + i * 13).collect();
    let span = ids.len()..ids.len() + img.tokens(2);
    ids.extend(std::iter::repeat_n(IMAGE_TOKEN, img.tokens(2)));
    ids.extend([40, 57, 74]);
    (ids, span)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_image_that_fails_to_encode_fails_only_its_request() {
    let good = image();
    let (ids, span) = prompt_with(&good);
    // Right grid and span, wrong pixel count: the tower refuses it, the API could not tell.
    let mut broken = prompt_image(span.clone(), &good);
    broken.pixel_values = Arc::from(&good.pixel_values[..good.pixel_values.len() - 1]);
    broken.hash ^= 1;

    // Both in one step (12 tokens each, a 64-token budget), their images in one encode call.
    let e = engine(1).await;
    let (bad, ok) = tokio::join!(
        reply(&e, ids.clone(), vec![broken.clone()]),
        reply(&e, ids.clone(), vec![prompt_image(span.clone(), &good)]),
    );
    match bad {
        Err(EngineError::Invalid(m)) => assert!(m.contains("could not encode"), "{m}"),
        other => panic!("the broken image's request: {other:?}"),
    }
    let ok = ok.expect("the good request beside it");
    e.shutdown();
    let fresh = engine(1).await;
    let alone = reply(&fresh, ids.clone(), vec![prompt_image(span, &good)]).await.expect("alone");
    assert_eq!(ok, alone, "the good request equals the same request alone on a fresh engine");
    fresh.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tensor_parallelism_refuses_images_up_front() {
    let good = image();
    let (ids, span) = prompt_with(&good);
    let e = engine(2).await;
    let refused = e.model().vision.as_ref().and_then(|v| v.refused.clone()).expect("a reason");
    assert!(refused.contains("--tp 2"), "{refused}");
    let mut req = common::greedy_request(ids.clone(), MAX_TOKENS);
    req.images = vec![prompt_image(span, &good)];
    match e.submit(req) {
        Err(EngineError::Invalid(m)) => assert!(m.contains("tensor parallelism"), "{m}"),
        Err(other) => panic!("refused for another reason: {other}"),
        Ok(_) => panic!("an image was accepted under --tp 2"),
    }
    // Text still runs.
    let (tokens, _) =
        common::run_greedy(&e, ids.iter().map(|&t| if t == IMAGE_TOKEN { 7 } else { t }).collect(), 3).await;
    assert_eq!(tokens.len(), 3);
    e.shutdown();
}
