"""The instance sagas and what runs them: definition.py (what a saga is), engine.py (running one durably,
under a lease), pace.py (backpressure), common.py (steps shared by starts and migrations), create.py,
start.py and migrate.py (one saga each, its step table at the top). The sagas themselves are imported from
their modules (`sagas.start.START`), which import the rest of the service."""

from services.instance_manager.sagas.definition import (
    Context,
    LeaseLost,
    Output,
    Params,
    Saga,
    Status,
    Step,
    StepFailed,
)
from services.instance_manager.sagas.engine import AT_ONCE, LEASE, RENEW, Executor, process_owner
from services.instance_manager.sagas.pace import Pace

__all__ = [
    "AT_ONCE",
    "LEASE",
    "RENEW",
    "Context",
    "Executor",
    "LeaseLost",
    "Output",
    "Pace",
    "Params",
    "Saga",
    "Status",
    "Step",
    "StepFailed",
    "process_owner",
]
