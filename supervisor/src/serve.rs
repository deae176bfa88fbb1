//! The executor process's side: serves an [`Executor`] over the link the node passed.

use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::Duration;

use djinn_node_core::link::{FromExecutor, ToExecutor};
use djinn_node_core::{Answer, Executor, Replier, Reply};
use djinn_proto::ErrorCode;
use djinn_shm::{Producer, Region};

use crate::SupervisorError;
use crate::channel::{self, BulkOut, link_limits};

/// How long the executor polls for the next job before it sleeps: a job that follows its
/// predecessor's answer closely costs no wake-up.
const JOB_SPIN: Duration = Duration::from_micros(20);

/// Serves `executor` over the link in the region `fd` (what [`crate::ProcessExecutor`] passes
/// at [`crate::LINK_FD`]): says it is ready, then runs each job the node sends and sends back
/// every answer, until the link breaks. The node's going ends the process first (its
/// parent-death signal).
pub fn serve<E: Executor>(fd: OwnedFd, mut executor: E) -> Result<(), SupervisorError> {
    let region = Arc::new(Region::open(fd)?);
    let mut ends = channel::attach(&region)?;
    let limits = link_limits();
    let mut message = Vec::new();
    FromExecutor::Ready { epoch: executor.epoch() }.encode(&mut message, &mut ends.answer_bulk)?;
    channel::push(&mut ends.answers, &message, &|| true)?;

    let (replier, answered) = Replier::new(Arc::new(|| {}));
    let (answers, answer_bulk) = (ends.answers, ends.answer_bulk);
    std::thread::Builder::new()
        .name("link-answers".into())
        .spawn(move || send_answers(answered, answers, answer_bulk))
        .map_err(SupervisorError::Thread)?;

    ends.jobs.set_spin(JOB_SPIN);
    loop {
        if !ends.jobs.pop(&mut message)? {
            ends.jobs.wait(Duration::from_secs(1));
            continue;
        }
        match ToExecutor::decode(&message, &limits, &mut ends.job_bulk)? {
            ToExecutor::Run { job, to } => executor.run(job, to, &replier),
            ToExecutor::FreeKept(ids) => executor.free_kept(&ids),
            ToExecutor::FreeParked(ids) => executor.free_parked(&ids),
            ToExecutor::FreeSessions(ids) => executor.free_sessions(&ids),
        }
    }
}

/// Sends each answer the executor gives its replier up the link, in the order given.
fn send_answers(
    answered: crossbeam_channel::Receiver<(djinn_node_core::ReplyTo, Answer)>,
    mut ring: Producer,
    mut bulk: BulkOut,
) {
    let mut message = Vec::new();
    for (to, answer) in answered {
        message.clear();
        let answer = FromExecutor::Answered { to, answer };
        if let Err(e) = answer.encode(&mut message, &mut bulk) {
            // The request is still answered; the bytes placed for the answer that was not
            // sent are dropped by the node's next take.
            message.clear();
            let refusal = Reply::error(ErrorCode::FrameTooLarge, format!("the answer cannot cross the link: {e}"));
            let refused = FromExecutor::Answered { to, answer: Answer::Executed(refusal.into()) };
            if let Err(e) = refused.encode(&mut message, &mut bulk) {
                tracing::error!(error = %e, "cannot encode a refusal for the link");
                continue;
            }
        }
        if let Err(e) = channel::push(&mut ring, &message, &|| true) {
            tracing::error!(error = %e, "cannot send an answer up the link; the node will find this executor lost");
            return;
        }
    }
}
