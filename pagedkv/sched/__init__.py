"""Requests, sampling parameters, the scheduler and the batch description it emits."""

from pagedkv.sched.output import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from pagedkv.sched.request import Request, RequestStatus
from pagedkv.sched.sampling_params import SamplingParams

__all__ = [
    "ModelRunnerOutput",
    "Request",
    "RequestStatus",
    "SamplingParams",
    "ScheduledRequest",
    "SchedulerOutput",
]
