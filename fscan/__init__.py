"""fscan: a functional associative scan for PyTorch, in the style of JAX's.

The public face only re-exports; every implementation module is private.
"""

from . import _route_why  # noqa: F401  (registers the reasons of the "fscan" log's records)
from . import lax as lax
from ._config import config as config
from ._engines.cpp.cpu_kernel import precompile as precompile
from ._errors import CombineFnError as CombineFnError
from ._errors import ImpureCombineError as ImpureCombineError
from ._errors import NotAssociativeError as NotAssociativeError
from ._errors import NotAssociativeWarning as NotAssociativeWarning
from ._errors import NotElementwiseError as NotElementwiseError
from ._errors import OutArgumentError as OutArgumentError
from ._errors import PeerRankError as PeerRankError
from ._errors import ReverseNotBoolWarning as ReverseNotBoolWarning
from ._errors import ScanError as ScanError
from ._errors import ScanIndexError as ScanIndexError
from ._errors import ScanTypeError as ScanTypeError
from ._errors import ScanValueError as ScanValueError
from ._errors import ScanWarning as ScanWarning
from ._errors import UnsupportedScanError as UnsupportedScanError
from ._explain import explain as explain
from ._knowledge.associativity import check_associative as check_associative
from ._knowledge.store import clear_caches as clear_caches
from ._linear import linear_recurrence as linear_recurrence
from ._linear_matrix import linear_recurrence_matrix as linear_recurrence_matrix
from ._log_linear import log_linear_recurrence as log_linear_recurrence
from ._ops import cummax as cummax
from ._ops import cummin as cummin
from ._ops import cumprod as cumprod
from ._ops import cumsum as cumsum
from ._ops import logcumsumexp as logcumsumexp
from ._reduce import associative_reduce as associative_reduce
from ._scan import associative_scan as associative_scan
from ._swap import swap_cumulative_ops as swap_cumulative_ops

__version__ = "0.1.0"

__all__ = [
    "CombineFnError",
    "ImpureCombineError",
    "NotAssociativeError",
    "NotAssociativeWarning",
    "NotElementwiseError",
    "OutArgumentError",
    "PeerRankError",
    "ReverseNotBoolWarning",
    "ScanError",
    "ScanIndexError",
    "ScanTypeError",
    "ScanValueError",
    "ScanWarning",
    "UnsupportedScanError",
    "associative_reduce",
    "associative_scan",
    "check_associative",
    "clear_caches",
    "config",
    "cummax",
    "cummin",
    "cumprod",
    "cumsum",
    "explain",
    "lax",
    "linear_recurrence",
    "linear_recurrence_matrix",
    "log_linear_recurrence",
    "logcumsumexp",
    "precompile",
    "swap_cumulative_ops",
]
