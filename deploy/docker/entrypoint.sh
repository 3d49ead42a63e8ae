#!/usr/bin/env bash
# The image's entrypoint, for every role: the Ascend runtime's environment when the image has
# it (vLLM-Ascend images keep it in the toolkit's set_env.sh scripts, read by login shells),
# then `motor run`, which starts the role MOTOR_ROLE names (docs/deployment.md).
for f in /usr/local/Ascend/ascend-toolkit/set_env.sh /usr/local/Ascend/nnal/atb/set_env.sh; do
    # shellcheck disable=SC1090
    [ -r "$f" ] && . "$f" > /dev/null 2>&1
done
exec motor run "$@"
