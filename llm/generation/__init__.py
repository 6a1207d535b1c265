"""Generation: the engine loop, scheduler and model runner, static batches, beams, speculation, how rows end.

The names below are its public surface: code outside llm/ imports them from here. Each is imported
from its module on first use (llmplan/lazy_exports.py), so importing the package costs nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmplan.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from .beam_search import Candidate
    from .draft_model import DraftModel
    from .ending import OPENAI_FINISH, OpenAIFinish, openai_finish, shown_finish
    from .engine_loop import EngineLoop, StepRecord
    from .model_runner import ModelRunner
    from .outputs import Generation
    from .request_runner import (
        BadLoopSettings,
        CannotRun,
        GenerationRun,
        LoopOptions,
        Outcome,
        PromptRequest,
        Refused,
        Vocabulary,
        run_requests,
        serving_loop,
    )
    from .scheduler import Scheduler
    from .static_batch import generate

EXPORTS = {  # name -> the module that defines it
    "BadLoopSettings": "request_runner",
    "Candidate": "beam_search",
    "CannotRun": "request_runner",
    "DraftModel": "draft_model",
    "EngineLoop": "engine_loop",
    "Generation": "outputs",
    "GenerationRun": "request_runner",
    "LoopOptions": "request_runner",
    "ModelRunner": "model_runner",
    "OPENAI_FINISH": "ending",
    "OpenAIFinish": "ending",
    "Outcome": "request_runner",
    "PromptRequest": "request_runner",
    "Refused": "request_runner",
    "Scheduler": "scheduler",
    "StepRecord": "engine_loop",
    "Vocabulary": "request_runner",
    "generate": "static_batch",
    "openai_finish": "ending",
    "run_requests": "request_runner",
    "serving_loop": "request_runner",
    "shown_finish": "ending",
}
__all__ = [
    "OPENAI_FINISH",
    "BadLoopSettings",
    "Candidate",
    "CannotRun",
    "DraftModel",
    "EngineLoop",
    "Generation",
    "GenerationRun",
    "LoopOptions",
    "ModelRunner",
    "OpenAIFinish",
    "Outcome",
    "PromptRequest",
    "Refused",
    "Scheduler",
    "StepRecord",
    "Vocabulary",
    "generate",
    "openai_finish",
    "run_requests",
    "serving_loop",
    "shown_finish",
]
__getattr__, __dir__ = lazy_exports(__name__, EXPORTS)
