"""ModelSummary: Lightning's table of modules and parameters, without a FLOPs count nobody measured.

Lightning counts FLOPs only for a module that defines `example_input_array` (it runs one forward pass
on it). A policy has no fixed input, so Lightning's default summary shows a FLOPs column of zeros and
"Total FLOPs: 0", which reads as a fault. This summary leaves the FLOPs out when none were counted and
is otherwise Lightning's plain table. The CLI uses it in place of Lightning's default summary.
"""
from __future__ import annotations

import logging
from typing import Any

from lightning.pytorch.callbacks import ModelSummary as LightningModelSummary
from lightning.pytorch.utilities.model_summary import get_formatted_model_size, get_human_readable_count

from lit_ess.knobs import check

log = logging.getLogger("lightning.pytorch.callbacks.model_summary")


class ModelSummary(LightningModelSummary):
    """Lightning's table of modules and parameters, without an uncounted FLOPs column.

    Args:
        max_depth: depth of nested modules listed (0 = no table, -1 = every depth).
    """

    def __init__(self, max_depth: int = 1, **summarize_kwargs: Any) -> None:
        check("ModelSummary.max_depth", max_depth, ge=-1, integer=True)
        super().__init__(max_depth, **summarize_kwargs)

    @staticmethod
    def summarize(summary_data, total_parameters, trainable_parameters, model_size, total_training_modes,
                  total_flops, **summarize_kwargs) -> None:
        if total_flops:
            return LightningModelSummary.summarize(summary_data, total_parameters, trainable_parameters, model_size,
                                                   total_training_modes, total_flops, **summarize_kwargs)
        columns = [(name, [str(v) for v in values]) for name, values in summary_data if name != "FLOPs"]
        widths = [max([len(name), *map(len, values)]) for name, values in columns]
        rows = [[name for name, _ in columns], *zip(*(values for _, values in columns))]
        lines = [" | ".join(f"{cell:<{w}}" for cell, w in zip(row, widths)).rstrip() for row in rows]
        rule = "-" * max(map(len, lines))
        totals = [(get_human_readable_count(trainable_parameters), "Trainable params"),
                  (get_human_readable_count(total_parameters - trainable_parameters), "Non-trainable params"),
                  (get_human_readable_count(total_parameters), "Total params"),
                  (get_formatted_model_size(model_size), "Total estimated model params size (MB)"),
                  (total_training_modes["train"], "Modules in train mode"),
                  (total_training_modes["eval"], "Modules in eval mode")]
        log.info("\n".join(["", lines[0], rule, *lines[1:], rule, *(f"{n:<10}{what}" for n, what in totals)]))
