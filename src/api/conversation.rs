//! A validated conversation → prompt ids and the [`ReplySetup`] that reads the reply: shared by
//! `/v1/chat/completions` and `/v1/messages`. Chooses how tools reach the model (the template's
//! own syntax, or the default tool prompt), renders the template, opens a forced call for
//! `tool_choice` required / named, and tokenizes. Runs on the blocking pool.

use serde_json::{Map, Value};

use super::errors::ApiError;
use super::media;
use super::output::ReplySetup;
use super::reasoning::{ReasoningStart, THINK_CLOSE};
use super::structured::{self, Constraint};
use super::tools::{self, TemplateTools, ToolChoice, ToolFormat, ToolSpec};
use super::{LaneState, TemplateState};
use crate::actors::handle::PromptImage;
use crate::tokenizer::bounded::proves_over;
use crate::tokenizer::chat::ChatRender;
use crate::tokenizer::TokenizerError;

/// A conversation in the OpenAI message shape (already normalised: `developer` → `system`,
/// text parts joined).
pub(crate) struct Conversation {
    pub messages: Vec<Value>,
    pub tools: Vec<ToolSpec>,
    pub tool_choice: ToolChoice,
    pub kwargs: Map<String, Value>,
    pub add_generation_prompt: bool,
    /// The request's remote media, fetched by the handler (`api::media_fetch`); empty when none.
    pub remote: media::Fetched,
}

pub(crate) struct RenderedPrompt {
    pub ids: Vec<u32>,
    pub reply: ReplySetup,
    /// Special tokens must stay in the reply's text for its parsers (see `output`).
    pub keep_special_tokens: bool,
    /// A stop string the request must add: a forced call ends the reply when it closes.
    pub stop_after_call: Option<&'static str>,
    /// The grammar that makes a forced call's arguments follow the tool's schema (Hermes and GLM
    /// syntax; `None` for other families and when nothing is forced).
    pub call_grammar: Option<Constraint>,
    /// The conversation's images and video frame pairs, their placeholders already expanded in
    /// `ids` (`api::media`).
    pub images: Vec<PromptImage>,
}

/// `param` names the field the conversation came in, for errors.
pub(crate) fn render(state: &LaneState, conv: Conversation, param: &'static str) -> Result<RenderedPrompt, ApiError> {
    let assets = state.shared.assets();
    let Some(tokenizer) = assets.tokenizer.as_ref() else {
        return Err(ApiError::unsupported(
            param,
            "this model has no tokenizer, so chat is unavailable; use /v1/completions with a prompt of token ids",
        ));
    };
    let template = match &assets.template {
        TemplateState::Ready(t) => t,
        TemplateState::Missing => {
            return Err(ApiError::unsupported(
                param,
                "this model has no chat template; use /v1/completions with a plain prompt",
            ))
        }
        TemplateState::Broken(e) => {
            return Err(ApiError::Internal(format!("the model's chat template is unusable: {e}")))
        }
    };
    let source = tokenizer.chat_template.as_deref().unwrap_or("");
    let syntax = TemplateTools::detect(source);
    let use_tools = !conv.tools.is_empty() && conv.tool_choice != ToolChoice::None;
    let mut messages = conv.messages;
    // Images and videos leave the messages before the template sees them (one bare `image` or
    // `video` part each); the cheap refusals (no vision tower, too many) come before any rendering
    // or decoding.
    let media_refs = media::take_media(&mut messages)?;
    let vision = state.shared.engine.model().vision.as_ref();
    media::check_media(&media_refs, vision, &state.shared.opts.media)?;
    let template_tools = if syntax.native {
        use_tools.then(|| tools::template_tools(&conv.tools))
    } else {
        // Earlier calls and results are rewritten even when no tools are offered now: the
        // template has no way to show them otherwise.
        tools::apply_default_prompt(&mut messages, if use_tools { &conv.tools[..] } else { &[] });
        None
    };
    let messages = Value::Array(messages);
    let request = ChatRender {
        messages: &messages,
        tools: template_tools.as_ref(),
        add_generation_prompt: conv.add_generation_prompt,
        kwargs: &conv.kwargs,
    };
    let Some(encoder) = assets.chat_encoder.as_ref() else {
        return Err(ApiError::Internal("the model's tokenizer cannot encode conversations safely".into()));
    };
    // Only the template's own markup becomes control tokens; text typed in a message stays text
    // (`tokenizer::literal`). The rendered template holds its special tokens, BOS included, as in HF.
    let template_error = |e: TokenizerError| match e {
        // Template errors are usually `raise_exception` calls about the conversation
        // ("roles must alternate"): the client's to fix.
        TokenizerError::Template(m) => {
            ApiError::invalid(param, format!("the chat template rejected the conversation: {m}"))
        }
        TokenizerError::Tokenizer(m) => ApiError::Internal(m),
    };
    let mut text = encoder.render(template, &request).map_err(template_error)?;
    let max_context = state.shared.engine.model().max_context;
    if let Some(at_least) = proves_over(tokenizer, text.text(), max_context).map_err(template_error)? {
        return Err(ApiError::prompt_over_context(max_context, at_least, param));
    }
    let mut reasoning = ReasoningStart::detect(source, text.text());
    // `required` with a single tool can only mean that tool: name it for the model.
    let choice = match (&conv.tool_choice, conv.tools.as_slice()) {
        (ToolChoice::Required, [only]) => ToolChoice::Named(only.name.clone()),
        (c, _) => c.clone(),
    };
    let forced_prefix = if use_tools { tools::forced_call_prefix(syntax.format, &choice) } else { None };
    let call_grammar = match &forced_prefix {
        Some(_) => {
            let compiler = structured::compiler(state, "tool_choice")?;
            tools::grammar::forced_call_grammar(syntax.format, &choice, &conv.tools, compiler.vocab())
                .map(|spec| Constraint { spec, param: "tools".into() })
        }
        None => None,
    };
    let stop_after_call = match syntax.format {
        ToolFormat::Hermes | ToolFormat::Glm if forced_prefix.is_some() => Some("</tool_call>"),
        _ => None,
    };
    if let Some(prefix) = &forced_prefix {
        // A forced call is the whole reply: close a reasoning block the template opened.
        if reasoning == ReasoningStart::Inside {
            text.push_markup(THINK_CLOSE);
            text.push_markup("\n");
        }
        reasoning = ReasoningStart::Off;
        text.push_markup(prefix);
    }
    let ids = encoder.encode(tokenizer, &text).map_err(template_error)?;
    let encode_text = |text: &str| tokenizer.encode(text, false).map_err(|e| ApiError::Internal(e.to_string()));
    let (ids, images) =
        media::attach_media(&media_refs, ids, vision, &state.shared.opts.media, &conv.remote, param, &encode_text)?;
    if ids.is_empty() {
        return Err(ApiError::invalid(param, "the conversation renders to an empty prompt"));
    }
    let parse_tools = use_tools.then_some((syntax.format, conv.tools));
    let needs_markers = parse_tools.is_some() || reasoning != ReasoningStart::Off;
    let (keep_special_tokens, strip) =
        if needs_markers { ReplySetup::special_tokens(tokenizer) } else { (false, Vec::new()) };
    Ok(RenderedPrompt {
        ids,
        reply: ReplySetup { reasoning, tools: parse_tools, forced_prefix, strip },
        keep_special_tokens,
        stop_after_call,
        call_grammar,
        images,
    })
}
