"""What the registry decided for a checkpoint (`ModelChoice`) and the two paths a model can run on; apart
from the registry so the transformers backend can name them without importing the registry back."""

from __future__ import annotations

from dataclasses import dataclass

from services.engine.models.family import Family

MODULE_PATH, TRANSFORMERS_PATH = "pagedserve", "transformers"


@dataclass
class ModelChoice:
    architecture: str
    path: str  # MODULE_PATH or TRANSFORMERS_PATH
    family: Family | None  # the family module's entry (MODULE_PATH only)
    hf_config: object  # transformers' config object for the checkpoint
