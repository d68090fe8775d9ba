"""Our model against transformers' own (``mla-fa3 validate``), one module per responsibility:

- :mod:`.validate` — the procedure (our engine, the reference, per-step rows and thresholds, the report);
- :mod:`.reference` — transformers' model of a checkpoint, FP8 block-scaled weights dequantized
  independently of our loader; teacher-forced logits.
"""

from mla_fa3.hf_compare.reference import dequantize_blocks, hf_reference_model, teacher_forced_logits
from mla_fa3.hf_compare.validate import (TOLERANCES, PositionScores, StepRow, ValidateReport, format_report,
                                         position_scores, report_json, run_validate)

__all__ = ["TOLERANCES", "StepRow", "PositionScores", "ValidateReport", "run_validate", "format_report", "report_json",
           "position_scores", "hf_reference_model", "dequantize_blocks", "teacher_forced_logits"]
