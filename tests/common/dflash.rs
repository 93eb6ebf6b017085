//! The DFlash fixtures shared by the CPU and GPU drafter tests: the llama target the drafters were
//! made for, and the reference's cases (`tests/fixtures/dflash/golden.json`).

use shelfserve::model::default_model::CacheDir;
use shelfserve::model::ModelBundle;

/// A fixture's path as a string (drafters are opened by path).
pub fn path(rel: &str) -> String {
    super::fixture(rel).to_str().unwrap().to_string()
}

/// The target the fixture drafters tap.
pub fn target() -> ModelBundle {
    shelfserve::model::open(&path("hf/llama3-tiny"), &CacheDir::from_env()).expect("open the target")
}

/// One reference case: the context, each drafter's proposals, and (where recorded) DFlash's draft
/// logits.
pub struct Case {
    pub context: Vec<u32>,
    pub dflash: Vec<u32>,
    pub dflash2: Vec<u32>,
    pub logits: Option<Vec<Vec<f32>>>,
}

pub fn golden() -> Vec<Case> {
    let text = std::fs::read_to_string(super::fixture("dflash/golden.json")).expect("golden.json");
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    let ids = |v: &serde_json::Value| -> Vec<u32> { serde_json::from_value(v.clone()).unwrap() };
    json["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| Case {
            context: ids(&c["context"]),
            dflash: ids(&c["proposals"]["dflash"]),
            dflash2: ids(&c["proposals"]["dflash2"]),
            logits: c.get("dflash_logits").map(|v| serde_json::from_value(v.clone()).unwrap()),
        })
        .collect()
}
