//! `RequestActor`: one per request. Owns what is private to one client: the detokenizer, the
//! stop-string matcher, the loop guard, usage counts and the event stream. Turns sampled tokens
//! into text deltas, ends the request on a stop string or a repeating output, and cancels it in the scheduler when the client
//! goes away.

use std::sync::Arc;

use ractor::{Actor, ActorProcessingErr, ActorRef};
use tokio::sync::mpsc::Sender;

use super::handle::{EngineError, FinishReason, StreamEvent, TokenInfo, Usage};
use super::scheduler::SchedulerMsg;
use crate::sampling::loop_guard::{LoopGuard, LoopGuardConfig};
use crate::sched::SeqId;
use crate::tokenizer::detok::IncrementalDetokenizer;
use crate::tokenizer::stop::{StopMatcher, StopOutcome};
use crate::tokenizer::TokenizerBundle;

#[derive(ractor_cluster::RactorMessage)]
pub enum RequestMsg {
    /// Tokens sampled for this request, in order.
    Tokens(Vec<TokenInfo>),
    /// The scheduler ended the request (EOS, max_tokens, context limit).
    Finished {
        reason: FinishReason,
    },
    Failed(EngineError),
    /// The client's stream was dropped.
    ClientGone,
    /// Prompt tokens the prefix cache served at admission (for `usage.cached_tokens`).
    PrefixHit {
        cached_tokens: usize,
    },
}

pub struct RequestArgs {
    pub seq: SeqId,
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    pub tokenizer: Option<Arc<TokenizerBundle>>,
    pub skip_special_tokens: bool,
    pub stop_strings: Vec<String>,
    pub loop_guard: LoopGuardConfig,
    pub events: Sender<StreamEvent>,
    pub scheduler: ActorRef<SchedulerMsg>,
}

pub struct RequestActor;

pub struct RequestState {
    seq: SeqId,
    usage: Usage,
    detok: Option<IncrementalDetokenizer>,
    stop: StopMatcher,
    loop_guard: Option<LoopGuard>,
    events: Sender<StreamEvent>,
    scheduler: ActorRef<SchedulerMsg>,
}

impl RequestState {
    /// Send an event, waiting if the client reads slowly (back-pressure on this request only);
    /// `false` means the client left.
    async fn send(&self, ev: StreamEvent) -> bool {
        self.events.send(ev).await.is_ok()
    }

    async fn finish(&mut self, myself: &ActorRef<RequestMsg>, reason: FinishReason, tail: String) {
        if !tail.is_empty() {
            self.send(StreamEvent::Delta { text: tail, tokens: Vec::new() }).await;
        }
        self.send(StreamEvent::Finished { reason, usage: self.usage }).await;
        myself.stop(None);
    }

    fn flush(&mut self) -> String {
        let mut tail = match self.detok.as_mut().map(|d| d.finish()) {
            Some(Ok(t)) => t,
            _ => String::new(),
        };
        if let StopOutcome::Continue { emit } = self.stop.push(&tail) {
            tail = emit;
        }
        tail.push_str(&self.stop.finish());
        tail
    }
}

impl Actor for RequestActor {
    type Msg = RequestMsg;
    type State = RequestState;
    type Arguments = RequestArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<RequestMsg>,
        a: RequestArgs,
    ) -> Result<RequestState, ActorProcessingErr> {
        // Watch for the client dropping its stream, so cancellation does not wait for a token.
        let watch = a.events.clone();
        let me = myself.clone();
        tokio::spawn(async move {
            watch.closed().await;
            let _ = me.cast(RequestMsg::ClientGone);
        });
        Ok(RequestState {
            seq: a.seq,
            usage: Usage { prompt_tokens: a.prompt_tokens, completion_tokens: 0, cached_tokens: a.cached_tokens },
            detok: a.tokenizer.map(|t| IncrementalDetokenizer::new(t, a.skip_special_tokens)),
            stop: StopMatcher::new(a.stop_strings),
            loop_guard: LoopGuard::new(a.loop_guard),
            events: a.events,
            scheduler: a.scheduler,
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<RequestMsg>,
        msg: RequestMsg,
        st: &mut RequestState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            RequestMsg::Tokens(tokens) => {
                let mut text = String::new();
                for (i, t) in tokens.iter().enumerate() {
                    st.usage.completion_tokens += 1;
                    let piece = match st.detok.as_mut() {
                        Some(d) => d.push(t.id).unwrap_or_default(),
                        None => String::new(),
                    };
                    match st.stop.push(&piece) {
                        StopOutcome::Continue { emit } => text.push_str(&emit),
                        StopOutcome::Stopped { emit, .. } => {
                            text.push_str(&emit);
                            let _ = st.scheduler.cast(SchedulerMsg::Cancel(st.seq));
                            st.send(StreamEvent::Delta { text, tokens: tokens[..=i].to_vec() }).await;
                            st.finish(&myself, FinishReason::Stop, String::new()).await;
                            return Ok(());
                        }
                    }
                    if st.loop_guard.as_mut().is_some_and(|g| g.push(t.id)) {
                        tracing::info!(
                            seq = st.seq,
                            tokens = st.usage.completion_tokens,
                            "loop guard: the output repeats itself; stopping"
                        );
                        let _ = st.scheduler.cast(SchedulerMsg::Cancel(st.seq));
                        st.send(StreamEvent::Delta { text, tokens: tokens[..=i].to_vec() }).await;
                        let tail = st.flush();
                        st.finish(&myself, FinishReason::Repetition, tail).await;
                        return Ok(());
                    }
                }
                if !st.send(StreamEvent::Delta { text, tokens }).await {
                    let _ = st.scheduler.cast(SchedulerMsg::Cancel(st.seq));
                    myself.stop(None);
                }
            }
            RequestMsg::Finished { reason } => {
                let tail = st.flush();
                st.finish(&myself, reason, tail).await;
            }
            RequestMsg::Failed(e) => {
                st.send(StreamEvent::Error(e)).await;
                myself.stop(None);
            }
            RequestMsg::PrefixHit { cached_tokens } => st.usage.cached_tokens = cached_tokens,
            RequestMsg::ClientGone => {
                let _ = st.scheduler.cast(SchedulerMsg::Cancel(st.seq));
                myself.stop(None);
            }
        }
        Ok(())
    }
}
