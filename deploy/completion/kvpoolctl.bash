# SPDX-License-Identifier: Apache-2.0
# bash completion for kvpoolctl: commands, their options, the values of -o, cache's `flush` and `dump`,
# help's command names, and namespaces after -n/--namespace/--join (asked of the daemon named
# by -s, or the default socket, with a short timeout: nothing when no daemon answers).
# Installed as ${datadir}/bash-completion/completions/kvpoolctl (bash-completion loads it on
# the first <TAB> after kvpoolctl); `source` it by hand otherwise. The lists come from the
# kvpoolctl being completed (its hidden `__complete`), so they never drift from the binary.

# kvpoolctl __complete ARGS..., stderr dropped; at most 2 s (namespaces ask the daemon).
_kvpoolctl_ask()
{
    if command -v timeout >/dev/null 2>&1; then
        timeout 2 "$@" 2>/dev/null
    else
        "$@" 2>/dev/null
    fi
}

_kvpoolctl()
{
    local cur="${COMP_WORDS[COMP_CWORD]}" prev="" bin="${COMP_WORDS[0]}"
    ((COMP_CWORD > 0)) && prev="${COMP_WORDS[COMP_CWORD - 1]}"
    # "--output=<TAB>": bash splits at '=' (COMP_WORDBREAKS)
    if [[ $cur == "=" ]]; then
        cur=""
    elif [[ $prev == "=" ]] && ((COMP_CWORD >= 2)); then
        prev="${COMP_WORDS[COMP_CWORD - 2]}"
    fi
    [[ $bin == "~"* ]] && bin="${bin/#\~/$HOME}"
    command -v "$bin" >/dev/null 2>&1 || bin=kvpoolctl
    COMPREPLY=()

    local valued
    valued=" $(_kvpoolctl_ask "$bin" __complete valued | tr '\n' ' ') "
    # the command, its first operand and the socket, from the words before the cursor
    local i w v cmd="" sub="" sock=()
    for ((i = 1; i < COMP_CWORD; i++)); do
        w="${COMP_WORDS[i]}"
        if [[ $valued == *" $w "* ]]; then
            v="${COMP_WORDS[i + 1]}"
            if [[ $v == "=" ]]; then
                ((i++))
                v="${COMP_WORDS[i + 1]}"
            fi
            ((i + 1 < COMP_CWORD)) && [[ $w == -s || $w == --socket ]] && sock=(-s "$v")
            ((i++))
            continue
        fi
        case $w in
        = | -*) continue ;;
        esac
        if [[ -z $cmd ]]; then
            cmd=$w
        elif [[ -z $sub ]]; then
            sub=$w
        fi
    done

    case $prev in
    -o | --output)
        mapfile -t COMPREPLY < <(compgen -W "$(_kvpoolctl_ask "$bin" __complete formats)" -- "$cur")
        return
        ;;
    -n | --namespace | --join)
        mapfile -t COMPREPLY < <(compgen -W \
            "$(_kvpoolctl_ask "$bin" "${sock[@]}" -t 1000 __complete namespaces)" -- "$cur")
        return
        ;;
    -s | --socket)
        mapfile -t COMPREPLY < <(compgen -f -- "$cur")
        return
        ;;
    esac
    [[ $valued == *" $prev "* ]] && return # a value kvpoolctl cannot guess (a number, a scope)

    if [[ $cur == -* ]]; then
        mapfile -t COMPREPLY < <(compgen -W "$(_kvpoolctl_ask "$bin" __complete options ${cmd:+"$cmd"})" \
            -- "$cur")
    elif [[ -z $cmd ]]; then
        mapfile -t COMPREPLY < <(compgen -W "$(_kvpoolctl_ask "$bin" __complete commands)" -- "$cur")
    elif [[ -z $sub ]]; then
        mapfile -t COMPREPLY < <(compgen -W "$(_kvpoolctl_ask "$bin" __complete words "$cmd")" \
            -- "$cur")
    fi
}

complete -F _kvpoolctl kvpoolctl
