//! Fixed-newstyle option haggling on one connection: which export, which reply format,
//! which metadata contexts. Ends in transmission, or in a closed connection.

use std::sync::Arc;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tracing::debug;

use super::Export;
use crate::log_limit::{warn_limited, REFUSED_REQUESTS};
use crate::wire::handshake::{
    encode_export_name_reply, encode_greeting, ClientOption, HandshakeError, InfoRequest,
    MetaContextRequest, OptionHeader, OptionReply, OPTION_HEADER_LEN,
};
use crate::wire::transmission::{ReplyStyle, RequestStyle};
use crate::wire::{
    client_flags, handshake_flags, info, rep, BASE_ALLOCATION, BASE_ALLOCATION_ID, MAX_OPTION_LEN,
    MAX_PAYLOAD, MIN_BLOCK_SIZE, PREFERRED_BLOCK_SIZE,
};

/// What negotiation agreed on.
pub struct Negotiated {
    pub export: Arc<Export>,
    pub request_style: RequestStyle,
    pub reply_style: ReplyStyle,
    /// `base:allocation` was selected for this export.
    pub base_allocation: bool,
    pub transmission_flags: u16,
}

/// Why negotiation ended without transmission.
#[derive(Debug, thiserror::Error)]
pub enum NegotiationEnd {
    #[error("client aborted the negotiation")]
    Aborted,
    #[error("connection closed during negotiation")]
    Closed,
    #[error(transparent)]
    Protocol(#[from] HandshakeError),
    #[error("export {0:?} requested with NBD_OPT_EXPORT_NAME does not exist")]
    UnknownExportName(String),
    #[error("malformed NBD_OPT_EXPORT_NAME: {0}")]
    BadExportName(String),
    #[error("NBD_OPT_EXPORT_NAME after extended headers were negotiated")]
    ExportNameWithExtendedHeaders,
    #[error("I/O error during negotiation: {0}")]
    Io(#[from] std::io::Error),
    #[error("NBD_OPT_EXPORT_NAME while the server stops: closing (it has no error reply)")]
    ExportNameWhileStopping,
}

impl NegotiationEnd {
    /// Whether this ending is the client's misbehaviour (and so worth a warning).
    pub fn is_violation(&self) -> bool {
        !matches!(
            self,
            NegotiationEnd::Aborted
                | NegotiationEnd::Closed
                | NegotiationEnd::ExportNameWhileStopping
        )
    }
}

/// The option-haggling state of one connection.
struct Haggle<'a> {
    exports: &'a [Arc<Export>],
    structured: bool,
    extended: bool,
    /// The export name and whether `base:allocation` was selected by the last
    /// `NBD_OPT_SET_META_CONTEXT`.
    meta: Option<(String, bool)>,
}

enum Step {
    Reply(Vec<OptionReply>),
    Transmit(Vec<OptionReply>, Negotiated),
    ExportName(Negotiated),
    Abort(Vec<OptionReply>),
}

impl<'a> Haggle<'a> {
    fn find(&self, name: &str) -> Option<&'a Arc<Export>> {
        self.exports.iter().find(|e| e.name == name)
    }

    fn reply_style(&self) -> ReplyStyle {
        if self.extended {
            ReplyStyle::Extended
        } else if self.structured {
            ReplyStyle::Structured
        } else {
            ReplyStyle::Simple
        }
    }

    fn negotiated(&self, export: &Arc<Export>) -> Negotiated {
        let reply_style = self.reply_style();
        let base_allocation = matches!(&self.meta, Some((name, true)) if *name == export.name);
        Negotiated {
            export: Arc::clone(export),
            request_style: if self.extended {
                RequestStyle::Extended
            } else {
                RequestStyle::Compact
            },
            reply_style,
            base_allocation,
            transmission_flags: export.transmission_flags(reply_style != ReplyStyle::Simple),
        }
    }

    fn step(&mut self, option: ClientOption) -> Result<Step, NegotiationEnd> {
        let code = option.code();
        let error =
            |kind, message: &str| Step::Reply(vec![OptionReply::error(code, kind, message)]);
        Ok(match option {
            ClientOption::ExportName(name) => {
                if self.extended {
                    return Err(NegotiationEnd::ExportNameWithExtendedHeaders);
                }
                let export = self
                    .find(&name)
                    .ok_or(NegotiationEnd::UnknownExportName(name))?;
                Step::ExportName(self.negotiated(export))
            }
            ClientOption::Abort => Step::Abort(vec![OptionReply::ack(code)]),
            ClientOption::List => {
                let mut replies: Vec<_> = self
                    .exports
                    .iter()
                    .map(|e| OptionReply::server(code, &e.name, &e.description))
                    .collect();
                replies.push(OptionReply::ack(code));
                Step::Reply(replies)
            }
            ClientOption::StartTls => error(rep::ERR_UNSUP, "TLS is not enabled on this server"),
            ClientOption::Info(request) => self.info(code, &request, false)?,
            ClientOption::Go(request) => self.info(code, &request, true)?,
            ClientOption::StructuredReply => {
                if self.extended {
                    error(
                        rep::ERR_EXT_HEADER_REQD,
                        "extended headers are already in use",
                    )
                } else {
                    self.structured = true;
                    Step::Reply(vec![OptionReply::ack(code)])
                }
            }
            ClientOption::ExtendedHeaders => {
                self.extended = true;
                Step::Reply(vec![OptionReply::ack(code)])
            }
            ClientOption::ListMetaContext(request) => self.meta_context(code, &request, false),
            ClientOption::SetMetaContext(request) => self.meta_context(code, &request, true),
            ClientOption::Unknown(other) => {
                error(rep::ERR_UNSUP, &format!("option {other} is not supported"))
            }
        })
    }

    fn info(&mut self, code: u32, request: &InfoRequest, go: bool) -> Result<Step, NegotiationEnd> {
        let Some(export) = self.find(&request.name) else {
            let message = format!("no export named {:?}", request.name);
            return Ok(Step::Reply(vec![OptionReply::error(
                code,
                rep::ERR_UNKNOWN,
                &message,
            )]));
        };
        let negotiated = self.negotiated(export);
        let mut replies = vec![OptionReply::info_export(
            code,
            export.backend.size(),
            negotiated.transmission_flags,
        )];
        if request.requests.contains(&info::NAME) {
            replies.push(OptionReply::info_string(code, info::NAME, &export.name));
        }
        if request.requests.contains(&info::DESCRIPTION) && !export.description.is_empty() {
            replies.push(OptionReply::info_string(
                code,
                info::DESCRIPTION,
                &export.description,
            ));
        }
        replies.push(OptionReply::info_block_size(
            code,
            MIN_BLOCK_SIZE,
            PREFERRED_BLOCK_SIZE,
            MAX_PAYLOAD,
        ));
        replies.push(OptionReply::ack(code));
        Ok(if go {
            Step::Transmit(replies, negotiated)
        } else {
            Step::Reply(replies)
        })
    }

    fn meta_context(&mut self, code: u32, request: &MetaContextRequest, set: bool) -> Step {
        if set {
            self.meta = None;
        }
        if !self.structured && !self.extended {
            let message = "negotiate structured replies or extended headers first";
            return Step::Reply(vec![OptionReply::error(code, rep::ERR_INVALID, message)]);
        }
        if self.find(&request.export).is_none() {
            let message = format!("no export named {:?}", request.export);
            return Step::Reply(vec![OptionReply::error(code, rep::ERR_UNKNOWN, &message)]);
        }
        let matches = |query: &str| {
            if set {
                query == BASE_ALLOCATION
            } else {
                query == BASE_ALLOCATION || query == "base:"
            }
        };
        let selected = if request.queries.is_empty() {
            !set
        } else {
            request.queries.iter().any(|q| matches(q))
        };
        let mut replies = Vec::new();
        if selected {
            let id = if set { BASE_ALLOCATION_ID } else { 0 };
            replies.push(OptionReply::meta_context(code, id, BASE_ALLOCATION));
        }
        replies.push(OptionReply::ack(code));
        if set {
            self.meta = Some((request.export.clone(), selected));
        }
        Step::Reply(replies)
    }
}

async fn send_replies<S: AsyncWrite + Unpin>(
    stream: &mut S,
    replies: &[OptionReply],
) -> std::io::Result<()> {
    let mut out = Vec::new();
    for reply in replies {
        reply.encode_into(&mut out);
    }
    stream.write_all(&out).await?;
    stream.flush().await
}

fn closed(e: std::io::Error) -> NegotiationEnd {
    if e.kind() == std::io::ErrorKind::UnexpectedEof {
        NegotiationEnd::Closed
    } else {
        NegotiationEnd::Io(e)
    }
}

/// Runs the handshake on `stream` until transmission starts or the connection must end.
/// Once `stopping` says the server stops, every further option but `NBD_OPT_ABORT` is
/// refused with `NBD_REP_ERR_SHUTDOWN`, as the spec asks ("Termination of the session
/// during option haggling"), so the client learns why instead of seeing the stream cut.
pub async fn negotiate<S>(
    stream: &mut S,
    exports: &[Arc<Export>],
    stopping: impl Fn() -> bool,
) -> Result<Negotiated, NegotiationEnd>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    stream
        .write_all(&encode_greeting(
            handshake_flags::FIXED_NEWSTYLE | handshake_flags::NO_ZEROES,
        ))
        .await?;
    stream.flush().await?;
    let client = stream.read_u32().await.map_err(closed)?;
    if client & !client_flags::KNOWN != 0 {
        return Err(HandshakeError::UnknownClientFlags(client).into());
    }
    let no_zeroes = client & client_flags::NO_ZEROES != 0;
    let mut haggle = Haggle {
        exports,
        structured: false,
        extended: false,
        meta: None,
    };
    loop {
        let mut header = [0u8; OPTION_HEADER_LEN];
        stream.read_exact(&mut header).await.map_err(closed)?;
        let header = OptionHeader::decode(&header)?;
        if header.length > MAX_OPTION_LEN {
            // Read past, and refused as the spec provides: the negotiation goes on.
            let skipped = tokio::io::copy(
                &mut (&mut *stream).take(u64::from(header.length)),
                &mut tokio::io::sink(),
            )
            .await
            .map_err(closed)?;
            if skipped < u64::from(header.length) {
                return Err(closed(std::io::ErrorKind::UnexpectedEof.into()));
            }
            if header.option == crate::wire::opt::ABORT {
                // Its data is ignored whatever its size (the spec: the server replies ACK).
                let _ = send_replies(stream, &[OptionReply::ack(header.option)]).await;
                return Err(NegotiationEnd::Aborted);
            }
            if header.option == crate::wire::opt::EXPORT_NAME {
                // It has no error reply.
                return Err(NegotiationEnd::BadExportName("longer than any name".into()));
            }
            if header.option == crate::wire::opt::SET_META_CONTEXT {
                haggle.meta = None;
            }
            let message = format!(
                "option of {} bytes: at most {MAX_OPTION_LEN} are read",
                header.length
            );
            let refusal = OptionReply::error(header.option, rep::ERR_TOO_BIG, &message);
            send_replies(stream, &[refusal]).await?;
            continue;
        }
        let mut data = vec![0u8; header.length as usize];
        stream.read_exact(&mut data).await.map_err(closed)?;
        let option = match ClientOption::parse(header.option, &data) {
            Ok(option) => option,
            Err(e) if header.option == crate::wire::opt::EXPORT_NAME => {
                return Err(NegotiationEnd::BadExportName(e.reason.to_string()))
            }
            Err(e) => {
                warn_limited!(REFUSED_REQUESTS, "malformed option: {e}");
                if header.option == crate::wire::opt::SET_META_CONTEXT {
                    // The spec: SET_META_CONTEXT replaces the selection even when it fails.
                    haggle.meta = None;
                }
                send_replies(
                    stream,
                    &[OptionReply::error(
                        header.option,
                        rep::ERR_INVALID,
                        e.reason,
                    )],
                )
                .await?;
                continue;
            }
        };
        debug!(?option, "option");
        if stopping() {
            match option {
                ClientOption::Abort => {}
                ClientOption::ExportName(_) => return Err(NegotiationEnd::ExportNameWhileStopping),
                _ => {
                    let refusal = OptionReply::error(
                        header.option,
                        rep::ERR_SHUTDOWN,
                        "the server is stopping",
                    );
                    send_replies(stream, &[refusal]).await?;
                    continue;
                }
            }
        }
        match haggle.step(option)? {
            Step::Reply(replies) => send_replies(stream, &replies).await?,
            Step::Transmit(replies, negotiated) => {
                send_replies(stream, &replies).await?;
                return Ok(negotiated);
            }
            Step::ExportName(negotiated) => {
                let export = &negotiated.export;
                let reply = encode_export_name_reply(
                    export.backend.size(),
                    negotiated.transmission_flags,
                    no_zeroes,
                );
                stream.write_all(&reply).await?;
                stream.flush().await?;
                return Ok(negotiated);
            }
            Step::Abort(replies) => {
                // The client may already have gone; a failed reply changes nothing.
                let _ = send_replies(stream, &replies).await;
                return Err(NegotiationEnd::Aborted);
            }
        }
    }
}
