//! shelfserve: an LLM serving engine. The crate is split by concern; each module's doc says what
//! it owns and what it must not touch.

pub mod actors;
pub mod api;
pub mod backend;
pub mod capacity;
pub mod cli;
pub mod cluster;
pub mod config;
pub mod fidelity;
pub mod generate;
pub mod kv;
pub mod media;
pub mod model;
pub mod parallel;
pub mod sampling;
pub mod sched;
pub mod spec;
pub mod spill;
pub mod structured;
pub mod tokenizer;
