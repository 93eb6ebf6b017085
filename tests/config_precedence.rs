//! Configuration precedence through the real binary: `shelfserve serve --dry-run` prints every
//! resolved scheduler knob with its source, for flags, environment variables, a configuration
//! file, the model family's defaults (the tiny glm5_next fixture) and the CPU's defaults.
//! Checked against issue 21's bug: `--block-size` left at its default overrode the file.

mod common;

use std::process::Command;

const FILE: &str = r#"
[scheduler]
block_size = 32
max_num_seqs = 8
max_num_batched_tokens = 256

[[lane]]
name = "voice"
port = 8888
priority = 10
default_max_tokens = 16
max_tokens_limit = 64
"#;

/// `serve --dry-run` on the tiny glm5_next fixture with `args` and `env`, every other
/// SHELFSERVE_ variable removed; its stdout.
fn dry_run(args: &[&str], env: &[(&str, &str)]) -> String {
    let model = common::fixture("glm5/tiny");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_shelfserve"));
    for (k, _) in std::env::vars().filter(|(k, _)| k.starts_with("SHELFSERVE_")) {
        cmd.env_remove(k);
    }
    cmd.args(["serve", "--dry-run", "--device", "cpu", "--model", model.to_str().unwrap()]).args(args);
    cmd.envs(env.iter().copied());
    let out = cmd.output().expect("run shelfserve");
    assert!(out.status.success(), "serve --dry-run failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).expect("utf-8")
}

fn knob(out: &str, name: &str) -> String {
    let prefix = format!("{name} = ");
    out.lines().find_map(|l| l.strip_prefix(&prefix)).unwrap_or_else(|| panic!("no `{name}` in\n{out}")).to_string()
}

#[test]
fn flag_beats_env_beats_file_beats_family_beats_device() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("serve.toml");
    std::fs::write(&file, FILE).unwrap();
    let config = ["--config", file.to_str().unwrap()];

    // No flags, no file: glm5_next's family page and block, the CPU's sequence budget.
    let out = dry_run(&[], &[]);
    assert_eq!(knob(&out, "block_size"), "64 (family)");
    assert_eq!(knob(&out, "page_tokens"), "3584 (family)");
    assert_eq!(knob(&out, "max_num_batched_tokens"), "7168 (family)");
    assert_eq!(knob(&out, "max_num_seqs"), "32 (device)");
    assert!(out.contains("lane voice port = 8888 max_queue = 64"), "{out}");

    // The file beats the family and the device; a flag that is not given overrides nothing.
    let out = dry_run(&config, &[]);
    assert_eq!(knob(&out, "block_size"), "32 (file)");
    assert_eq!(knob(&out, "max_num_seqs"), "8 (file)");
    assert_eq!(knob(&out, "page_tokens"), "3584 (family)");
    assert!(out.contains("lane voice port = 8888 max_queue = 16"), "twice the file's max_num_seqs\n{out}");

    // The environment beats the file; a flag beats the environment.
    let out = dry_run(&config, &[("SHELFSERVE_BLOCK_SIZE", "128"), ("SHELFSERVE_MAX_NUM_SEQS", "4")]);
    assert_eq!(knob(&out, "block_size"), "128 (flag/env)");
    assert_eq!(knob(&out, "max_num_seqs"), "4 (flag/env)");
    let out = dry_run(&[&config[..], &["--block-size", "16"]].concat(), &[("SHELFSERVE_BLOCK_SIZE", "128")]);
    assert_eq!(knob(&out, "block_size"), "16 (flag/env)");
}

#[test]
fn the_card_prices_the_glm5_cache_layout_and_a_bad_resolution_is_refused() {
    let out = dry_run(&["--kv-pool-tokens", "640"], &[]);
    assert_eq!(knob(&out, "kv_dtype"), "f32");
    assert_eq!(knob(&out, "pool_tokens"), "640 (Configured)");
    let per_token: u64 = knob(&out, "kv_bytes_per_token").parse().unwrap();
    assert_eq!(knob(&out, "kv_pool_bytes"), (640 * per_token).to_string());
    assert!(knob(&out, "state_bytes_per_sequence").parse::<u64>().unwrap() > 0, "KDA state per sequence");

    // A page that is not whole blocks is refused before loading, naming both knobs.
    let model = common::fixture("glm5/tiny");
    let out = Command::new(env!("CARGO_BIN_EXE_shelfserve"))
        .args(["serve", "--dry-run", "--device", "cpu", "--model", model.to_str().unwrap(), "--page-tokens", "100"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("page_tokens (100) must be a multiple of block_size (64)"), "{err}");
}
