"""The provider-batch lane's modules under their paths before `udfs/lanes/provider_batch/`. A
savepoint of that lane holds `Held` and `BatchEntry` pickled as `udfs.provider_batch.entries.*`
(`Types.PICKLED_BYTE_ARRAY` state), so each old module name is the new module itself and such a
savepoint restores (`tests/unit/udfs/lanes/test_batch_lane.py`). Nothing of the project imports this package."""

import importlib
import sys

MOVED = {
    "entries": "udfs.lanes.provider_batch.entries",
    "providers": "udfs.lanes.provider_batch.providers",
}

for _old, _new in MOVED.items():
    sys.modules.setdefault(f"{__name__}.{_old}", importlib.import_module(_new))
