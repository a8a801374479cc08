"""The sim backend's own settings group, `[sim]`: the machine it simulates and the faults it injects."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

#: A path or a fault spec: never empty (`--set sim.profile=` is a mistake, not "no profile").
NonEmpty = Annotated[str, StringConstraints(min_length=1, strip_whitespace=True)]


class SimSettings(BaseModel):
    """The simulated device of the 'sim' backend."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    profile: NonEmpty | None = Field(None, description="A strata.profile/1 or strata.scenario/1 file the sim device "
                                                       "takes its facts from (None: built-in 24 GiB card)")
    inject: list[NonEmpty] = Field(default_factory=list, description="Fault specs the sim backend injects (see "
                                                                     "`strata simulate --help`)")
