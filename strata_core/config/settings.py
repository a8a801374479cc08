"""The settings' public names in one place (kept so `strata_core.config.settings` imports keep working).

The code lives in `schema` (the groups and their bounds), `sources` (flags, env, legacy env, TOML, provenance),
`cli_args` (the shared flags and bounded argparse types) and `table` (the generated docs table).
"""

from strata_core.config.cli_args import *  # noqa: F401,F403
from strata_core.config.cli_args import _parse_set  # noqa: F401
from strata_core.config.schema import *  # noqa: F401,F403
from strata_core.config.sources import *  # noqa: F401,F403
from strata_core.config.sources import _coerce_text, _Entry, _env_entries, _find_toml, _flag_entries, _nest, _toml_entries, _unknown_key  # noqa: F401
from strata_core.config.table import *  # noqa: F401,F403
