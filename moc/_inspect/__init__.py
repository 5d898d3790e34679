"""``moc inspect``: a store's summary and per-unit table (:mod:`.summary`), the snapshot
buffers of a memory directory and what a restore would take from them (:mod:`.memory`),
and the expert-age heatmap (:mod:`.plot`; matplotlib is imported only when one is drawn)."""

from .memory import find_folders, format_memory, memory_report
from .plot import write_heatmap
from .summary import format_summary, format_units, header_lines, human, summarize

__all__ = ["format_summary", "format_units", "header_lines", "human", "summarize", "find_folders", "format_memory",
           "memory_report", "write_heatmap"]
