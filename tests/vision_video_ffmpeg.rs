//! Video containers decoded with the ffmpeg libraries (`video-ffmpeg` feature; plain `cargo test`
//! compiles this file to nothing). Run it with
//! `cargo test --profile test --features video-ffmpeg --test vision_video_ffmpeg` on a machine
//! with the packages docs/vision.md lists (the `ffmpeg` CLI makes the videos at test time, and
//! Python needs `transformers` and `av`):
//! - the frames `media::container::decode_video` keeps of a real mp4 (H.264) and webm (VP9),
//!   8 frames of ffmpeg's `testsrc` at 64×48 and 2 fps, equal the frames transformers'
//!   `load_video(backend="pyav")` decodes at the same indices (bit for bit: both convert with
//!   swscale's bilinear yuv420p → rgb24; measured 0 levels differ on Debian 12's FFmpeg 5.1), and
//!   the container metadata (frame count, rate) equals PyAV's;
//! - the real binary gives, greedy, the same reply for a `video_url` data URL of the mp4 as for
//!   the same decoded frames sent as a frame list (`{"type": "video", "video": [...], "fps": 2}`).
#![cfg(feature = "video-ffmpeg")]

mod binary_server;
mod common;
mod e2e_http;

use std::path::{Path, PathBuf};
use std::process::Command;

use base64::Engine as _;
use binary_server::{python, python_has, Server};
use serde_json::{json, Value};
use shelfserve::media::container::{decode_video, DecodedVideo, VideoLimits};
use shelfserve::media::{RgbImage, VideoProcessor};

const MODEL: &str = "glm5-vision";
const FPS: f64 = 2.0;

fn fixture_dir() -> PathBuf {
    common::fixture("glm5/vision-chat")
}

/// 8 frames of `testsrc` (64×48, 2 fps) encoded with `codec` into `dir/name`.
fn make_video(dir: &Path, name: &str, codec: &[&str]) -> PathBuf {
    let path = dir.join(name);
    let out = Command::new("ffmpeg")
        .args(["-v", "error", "-y", "-f", "lavfi", "-i", "testsrc=size=64x48:rate=2", "-frames:v", "8"])
        .args(["-pix_fmt", "yuv420p"])
        .args(codec)
        .arg(&path)
        .output()
        .expect("run the ffmpeg CLI (docs/vision.md lists the packages)");
    assert!(out.status.success(), "ffmpeg failed: {}", String::from_utf8_lossy(&out.stderr));
    path
}

fn decode(path: &Path) -> DecodedVideo {
    let bytes = std::fs::read(path).expect("read the video");
    let processor = VideoProcessor::from_dir(&fixture_dir()).expect("the fixture's video settings");
    decode_video(&bytes, &processor, VideoLimits { max_frames: 64, max_pixels: 1 << 24 }).expect("decode")
}

const PYAV: &str = r#"
import json, sys
import numpy as np
from transformers.video_utils import load_video
path, indices, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
video, meta = load_video(path, backend="pyav", sample_indices_fn=lambda metadata, **kw: indices)
np.ascontiguousarray(video, dtype=np.uint8).tofile(out)
print(json.dumps({"shape": list(video.shape), "total": int(meta.total_num_frames), "fps": float(meta.fps)}))
"#;

#[test]
fn decoded_frames_equal_transformers_pyav() {
    assert!(python_has(&["transformers", "av"]), "`{}` needs transformers and av (pip install av)", python());
    let dir = tempfile::tempdir().expect("temp dir");
    for (name, codec, states_count) in [
        ("clip.mp4", &["-c:v", "libx264"][..], true),
        ("clip.webm", &["-c:v", "libvpx-vp9", "-b:v", "200k"][..], false),
    ] {
        let path = make_video(dir.path(), name, codec);
        let d = decode(&path);
        assert_eq!(d.fps, FPS, "{name}: rate");
        assert_eq!(d.indices, (0..8).collect::<Vec<_>>(), "{name}: every frame of 4 s at the processor's 2 fps");
        let golden = dir.path().join(format!("{name}.rgb"));
        let out = Command::new(python())
            .args(["-c", PYAV])
            .arg(&path)
            .arg(serde_json::to_string(&d.indices).expect("json"))
            .arg(&golden)
            .output()
            .expect("run python");
        assert!(out.status.success(), "{name}: pyav failed: {}", String::from_utf8_lossy(&out.stderr));
        let meta: Value = serde_json::from_slice(&out.stdout).expect("pyav's json line");
        assert_eq!(meta["shape"], json!([8, 48, 64, 3]), "{name}");
        assert_eq!(meta["fps"].as_f64(), Some(FPS), "{name}: PyAV's average rate");
        if states_count {
            // webm states no count (PyAV says 0; we count packets, which transformers cannot).
            assert_eq!(meta["total"].as_u64(), Some(8), "{name}: PyAV's frame count");
        }
        let want = std::fs::read(&golden).expect("read pyav's frames");
        let got: Vec<u8> = d.frames.iter().flat_map(|f: &RgbImage| f.data.iter().copied()).collect();
        assert_eq!(got.len(), want.len(), "{name}: byte count");
        let max = got.iter().zip(&want).map(|(a, b)| a.abs_diff(*b)).max().unwrap_or(0);
        let differ = got.iter().zip(&want).filter(|(a, b)| a != b).count();
        eprintln!("{name}: {differ} of {} levels differ from PyAV, by at most {max}", got.len());
        assert_eq!(max, 0, "{name}: {differ} levels differ from PyAV, by up to {max}");
    }
}

fn png_data_url(f: &RgbImage) -> String {
    let img = image::RgbImage::from_raw(f.width, f.height, f.data.clone()).expect("frame size");
    let mut png = Vec::new();
    img.write_to(&mut std::io::Cursor::new(&mut png), image::ImageFormat::Png).expect("encode png");
    format!("data:image/png;base64,{}", base64::engine::general_purpose::STANDARD.encode(png))
}

fn chat(server: &Server, video_part: Value) -> String {
    let body = json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": [video_part, {"type": "text", "text": "What happens in the video?"}]}],
        "max_tokens": 8,
        "temperature": 0,
        "chat_template_kwargs": {"enable_thinking": false},
    });
    let r = server.target("voice").post("/v1/chat/completions", &body).expect("/v1/chat/completions");
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()["choices"][0]["message"]["content"].as_str().expect("content").to_owned()
}

#[test]
fn a_served_mp4_replies_as_its_frames_do() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = make_video(dir.path(), "clip.mp4", &["-c:v", "libx264"]);
    let d = decode(&path);
    assert_eq!(d.indices, (0..8).collect::<Vec<_>>(), "the frame list below must be the same frames");
    let server = Server::start(&fixture_dir(), MODEL, &[], "ffmpeg");
    let b64 = base64::engine::general_purpose::STANDARD.encode(std::fs::read(&path).expect("read"));
    let from_mp4 =
        chat(&server, json!({"type": "video_url", "video_url": {"url": format!("data:video/mp4;base64,{b64}")}}));
    let urls: Vec<String> = d.frames.iter().map(png_data_url).collect();
    let from_frames = chat(&server, json!({"type": "video", "video": urls, "fps": FPS}));
    assert!(!from_mp4.is_empty(), "no reply text to compare");
    assert_eq!(from_mp4, from_frames);
}
