from typing import Any

CausalArgType = DimensionType = Any


class KernelSchedule:
    pass
