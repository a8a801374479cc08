"""Settings: one typed StrataSettings from flags, environment, legacy variables, TOML and defaults.

`schema` holds the groups and their physical bounds, `sources` layers the sources with the provenance of every
value (the only module that reads the environment), `cli_args` the flags every command shares, `table` the
generated docs table. The names below are the public ones.
"""

from strata_core.config.cli_args import (add_settings_arguments, bounded_int, flags_from_args, output_path,
                                         report_settings_from_args, seed_arg, settings_from_args)
from strata_core.config.schema import (FIELDS, GROUPS, SOURCES, BackendSettings, KvSettings, MemorySettings,
                                       PinningSettings, PluginSettings, PrefillSettings, SettingField,
                                       SettingsGroupModel, StrataSettings, fields_of, iter_fields,
                                       schema_with_groups)
from strata_core.config.sources import (LEGACY_VARIABLES, RETIRED_VARIABLES, ConfigFileError, FlagValue,
                                        LoadedSettings, Provenance, load_settings, plugin_groups, settings_from_partial,
                                        user_cache_dir, with_backend_defaults)
from strata_core.config.table import embed_table, legacy_table_rows, settings_table_markdown, settings_table_rows

__all__ = [
    "FIELDS", "GROUPS", "SOURCES", "LEGACY_VARIABLES", "RETIRED_VARIABLES",
    "BackendSettings", "KvSettings", "MemorySettings", "PinningSettings", "PluginSettings", "PrefillSettings",
    "StrataSettings", "SettingField", "SettingsGroupModel", "ConfigFileError", "FlagValue",
    "LoadedSettings", "Provenance",
    "add_settings_arguments", "bounded_int", "embed_table", "fields_of", "flags_from_args", "iter_fields",
    "legacy_table_rows", "load_settings", "output_path", "plugin_groups", "report_settings_from_args", "schema_with_groups",
    "seed_arg", "settings_from_args", "settings_from_partial", "settings_table_markdown", "settings_table_rows",
    "user_cache_dir", "with_backend_defaults",
]
