"""Our model against transformers' own (``mla-fa3 validate``), one module per responsibility:

- :mod:`.validate` — the procedure (our engine, the references, per-step rows and thresholds, the report);
- :mod:`.reference` — transformers' model of a checkpoint, FP8 block-scaled weights dequantized
  independently of our loader; teacher-forced logits;
- :mod:`.fp8_reference` — the e4m3 reference of an FP8 latent cache: transformers' modules in float64 with
  the cache (and FlashMLA's query) rounded as our path rounds them, step by step as our engine ran.
"""

from mla_fa3.hf_compare.fp8_reference import (TIE_WINDOW, CodeCheck, E4M3Reference, RowRun, StepRun,
                                              e4m3_reference_logits, record_steps, round_e4m3)
from mla_fa3.hf_compare.reference import dequantize_blocks, hf_reference_model, teacher_forced_logits
from mla_fa3.hf_compare.validate import (TOLERANCES, FP8Run, PositionScores, StepRow, ValidateReport, format_report,
                                         position_scores, report_json, run_validate)

__all__ = ["TOLERANCES", "StepRow", "PositionScores", "FP8Run", "ValidateReport", "run_validate", "format_report",
           "report_json", "position_scores", "hf_reference_model", "dequantize_blocks", "teacher_forced_logits",
           "RowRun", "StepRun", "CodeCheck", "E4M3Reference", "TIE_WINDOW", "record_steps", "e4m3_reference_logits",
           "round_e4m3"]
