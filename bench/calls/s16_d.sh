#!/usr/bin/env bash
# 2026-12-04 third session, H200 call 4: the wgmma path with a step's wgmmas running on into the next (4 input
# stages, 3 weight tiles), measured by the same steps as call 3 (s16_c.sh).
exec bash "$(dirname "${BASH_SOURCE[0]}")/s16_c.sh" "$@"
