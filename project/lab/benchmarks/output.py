"""The table and the chart of a run."""

from __future__ import annotations

from typing import Any

from .scale import NO_FLUSH_WAIT, WAL_COMPRESSION


def table(results: dict[str, Any]) -> str:
    """The results as fixed-width text tables, every throughput also as a ratio to the floor."""
    lines: list[str] = []
    info = results["machine"]
    lines.append(
        f"machine: {info.get('cpu', '?')} x{info['cpus']}, Python {info['python']}, "
        f"Django {info['django']}, {info['database']} {info.get('postgresql', info.get('mariadb', ''))}"
    )
    if results.get("note"):
        lines.append(results["note"])
    cycles = results.get("cycles")
    if cycles:
        for name, why in cycles["skipped"].items():
            lines.append(f"skipped {name}: {why}")
        gives = cycles.get("gives", {})
        if gives:
            lines.append("")
            lines.append(f"{'system':<20}{'token':<18}{'durable':<9}note")
            for name in cycles["systems"]:
                if name in gives:
                    what = gives[name]
                    lines.append(f"{name:<20}{what['token']:<18}{what['durable']:<9}{what['note']}")
        for workload in ("many_keys", "hot_key"):
            lines.append("")
            lines.append(f"acquire + release cycles, {workload.replace('_', ' ')}")
            lines.append(
                f"{'system':<20}{'clients':>8}{'ops/s':>10}{'x floor':>9}{'x hist':>8}"
                f"{'x below':>9}{'p50 ms':>9}{'p99 ms':>9}{'refused':>9}"
            )
            for name, series in cycles[workload].items():
                for row in series:
                    ratio = _ratio(row["ratio_to_floor"])
                    history = _ratio(row.get("ratio_to_history_floor"))
                    below = _ratio(row.get("ratio_to_layer_below"))
                    lines.append(
                        f"{name:<20}{row['clients']:>8}{row['ops_per_s']:>10.0f}{ratio:>9}"
                        f"{history:>8}{below:>9}{_ms(row['p50_ms']):>9}{_ms(row['p99_ms']):>9}"
                        f"{row['refused']:>9}"
                    )
            layers = [name for name in cycles.get("layers", []) if name in cycles[workload]]
            if len(layers) > 1:
                lines.append("layers, each x the one below (" + " < ".join(layers) + "):")
                for index, clients in enumerate(row["clients"] for row in cycles[workload][layers[0]]):
                    steps = "  ".join(
                        f"{name} {_ratio(cycles[workload][name][index].get('ratio_to_layer_below'))}"
                        for name in layers[1:]
                    )
                    lines.append(f"  {clients} clients: {steps}")
            for row in cycles[workload].get("locks_site_logging", []):
                lines.append(
                    f"locks with the site's LOGGING x locks at WARNING, {row['clients']} clients: "
                    f"{_ratio(row.get('ratio_to_locks'))}"
                )
    statements = results.get("statements")
    if statements:
        lines.append("")
        if "skipped" in statements:
            lines.append(f"statements: skipped ({statements['skipped']})")
        else:
            lines.append(
                f"server work per cycle, by statement (pg_stat_statements, track = all, "
                f"{statements['cycles']} cycles of one client); nested statements indented"
            )
            for name in ("raw_sql_floor", "floor_with_history", "app_functions"):
                part = statements[name]
                lines.append(f"{name}: {part['server_wal_bytes_per_cycle']} WAL bytes a cycle")
                for row in part["statements"]:
                    indent = "" if row["toplevel"] else "  "
                    lines.append(
                        f"  {row['exec_us_per_cycle']:>7.1f} us {row['wal_bytes_per_cycle']:>5} B "
                        f"{row['calls_per_cycle']:>5.2f}x  {indent}{row['statement'][:90]}"
                    )
    cpu = results.get("cpu")
    if cpu:
        lines.append("")
        if "skipped" in cpu:
            lines.append(f"cpu per cycle: skipped ({cpu['skipped']})")
        else:
            lines.append(
                f"CPU per cycle, one process over 64 keys ({cpu['blocks']} interleaved blocks of "
                f"{cpu['cycles_per_block']}, medians)"
                + (f"; server {cpu['server']}" if "server" in cpu else "")
            )
            lines.append(
                f"{'layer':<20}{'client us':>10}{'server us':>10}{'total us':>10}"
                f"{'implied x below':>17}"
            )
            for name, row in cpu["layers"].items():
                lines.append(
                    f"{name:<20}{_us(row['client_us']):>10}{_us(row['server_us']):>10}"
                    f"{_us(row['total_us']):>10}{_ratio(row['implied_x_below']):>17}"
                )
            site = cpu.get("site_logging")
            if site:
                lines.append(
                    f"locks with the site's LOGGING: client {_us(site['client_us'])} us, "
                    f"x locks at WARNING {_ratio(site['x_locks'])}"
                )
    fenced = results.get("fenced")
    if fenced:
        lines.append("")
        if "skipped" in fenced:
            lines.append(f"fenced_update: skipped ({fenced['skipped']})")
        else:
            lines.append("fenced_update against a plain ORM update() of the same row, 1 client")
            for mode in ("autocommit", "in_transaction"):
                for name, row in fenced[mode].items():
                    lines.append(
                        f"{mode:<15}{name:<24} p50 {_ms(row['p50_ms'])} ms  "
                        f"p99 {_ms(row['p99_ms'])} ms  x plain {row['over_plain']:.2f}"
                    )
            lines.append(
                f"fenced / plain (p50): {fenced['fenced_over_plain']:.2f} in autocommit, "
                f"{fenced['fenced_over_plain_in_transaction']:.2f} inside a transaction"
            )
    scale = results.get("scale")
    if scale:
        lines.append("")
        if "skipped" in scale:
            lines.append(f"row-count runs: skipped ({scale['skipped']})")
        else:
            lines.append(
                "acquire + release latency on existing keys, by table size, side by side "
                f"(shared_buffers {scale.get('shared_buffers', '?')}, checkpoint after the load: "
                f"{'yes' if scale.get('checkpoint_after_load') else 'no'})"
            )
            for row in scale["runs"]:
                lines.append(
                    f"{row['lock_rows']:>10} locks {row['grant_rows']:>10} grants  "
                    f"p50 {_ms(row['p50_ms'])} ms  p99 {_ms(row['p99_ms'])} ms  "
                    f"mean {_ms(row['mean_ms'])} ms  ({row.get('table_mb', '?')} MB, "
                    f"{row.get('wal_bytes_per_cycle', '?')} WAL bytes a cycle)"
                )
            lines.append(
                f"large / small: p50 {scale['large_over_small_p50']:.2f}, "
                f"p99 {scale['large_over_small_p99']:.2f}, mean {scale['large_over_small_mean']:.2f}"
            )
            variants = {
                NO_FLUSH_WAIT: "the same with synchronous_commit off (no wait for the WAL flush):",
                WAL_COMPRESSION: "durable, with wal_compression = {method}:",
            }
            for mode, title in variants.items():
                variant = scale.get(mode)
                if not variant:
                    continue
                if "skipped" in variant:
                    lines.append(f"{mode}: skipped ({variant['skipped']})")
                    continue
                lines.append(title.format(method=variant.get("method")))
                for row in variant["runs"]:
                    lines.append(
                        f"{row['lock_rows']:>10} locks {row['grant_rows']:>10} grants  "
                        f"p50 {_ms(row['p50_ms'])} ms  p99 {_ms(row['p99_ms'])} ms  "
                        f"mean {_ms(row['mean_ms'])} ms  "
                        f"({row.get('wal_bytes_per_cycle', '?')} WAL bytes a cycle)"
                    )
                lines.append(
                    f"large / small: p50 {variant['large_over_small_p50']:.2f}, "
                    f"p99 {variant['large_over_small_p99']:.2f}, "
                    f"mean {variant['large_over_small_mean']:.2f}"
                )
    wakeup = results.get("wakeup")
    if wakeup:
        lines.append("")
        lines.append("wake-up latency, release to the waiter's grant")
        for mode, row in wakeup.items():
            lines.append(
                f"{mode:<10} p50 {_ms(row['p50_ms'])} ms  p99 {_ms(row['p99_ms'])} ms  "
                f"max {_ms(row['max_ms'])} ms  ({row['samples']} samples)"
            )
    fairness = results.get("fairness")
    if fairness:
        lines.append("")
        lines.append("one key, threads looping acquire(wait) / 2 ms of work / release")
        for mode in ("unfair", "fair"):
            row = fairness[mode]
            lines.append(
                f"{mode:<8} {row['cycles_per_s']:>7.0f} cycles/s  grants per thread "
                f"{row['grants_per_thread_min']}..{row['grants_per_thread_max']}  "
                f"wait p50 {_ms(row['wait_p50_ms'])} ms  max {_ms(row['wait_max_ms'])} ms"
            )
    celery = results.get("celery")
    if celery:
        lines.append("")
        if "skipped" in celery:
            lines.append(f"celery: skipped ({celery['skipped']})")
        else:
            lines.append("celery task, fenced against the same task writing with update()")
            for part in ("end_to_end", "end_to_end_persistent", "end_to_end_persistent_working"):
                worker = celery.get(part)
                if worker is None:
                    continue
                if "skipped" in worker:
                    lines.append(f"through a worker: skipped ({worker['skipped']})")
                    continue
                lines.append(
                    f"through a worker ({worker['how']}): "
                    f"fenced {_rate(worker['fenced']['tasks_per_s'])} tasks/s, "
                    f"p50 {_ms(worker['fenced']['p50_ms'])} ms, "
                    f"p99 {_ms(worker['fenced']['p99_ms'])} ms; "
                    f"unfenced {_rate(worker['unfenced']['tasks_per_s'])} tasks/s, "
                    f"p50 {_ms(worker['unfenced']['p50_ms'])} ms, "
                    f"p99 {_ms(worker['unfenced']['p99_ms'])} ms; "
                    f"ratio p50 {worker['fenced_over_unfenced']:.2f}, "
                    f"throughput {_ratio(worker['fenced_over_unfenced_throughput'])}"
                )
                if "fenced_once" in worker:
                    lines.append(
                        f"  with once=True: p50 {_ms(worker['fenced_once']['p50_ms'])} ms, "
                        f"p99 {_ms(worker['fenced_once']['p99_ms'])} ms, "
                        f"{_rate(worker['fenced_once']['tasks_per_s'])} tasks/s; "
                        f"p50 over fenced {worker['once_over_fenced']:.2f}"
                    )
            local = celery["in_process"]
            lines.append(
                f"in process ({local['how']}): fenced p50 {_ms(local['fenced']['p50_ms'])} ms, "
                f"unfenced p50 {_ms(local['unfenced']['p50_ms'])} ms, "
                f"ratio {local['fenced_over_unfenced']:.2f}"
            )
            for name in ("fenced", "unfenced"):
                parts = local.get(f"{name}_steps_us")
                if parts:
                    lines.append(
                        f"  {name}, p50 of each part: "
                        + ", ".join(f"{step} {us} µs" for step, us in parts.items())
                    )
            if "fenced_once" in local:
                lines.append(
                    f"  with once=True: p50 {_ms(local['fenced_once']['p50_ms'])} ms "
                    f"(over fenced {local['once_over_fenced']:.2f}); a completed task id "
                    f"again: p50 {_ms(local['once_repeat']['p50_ms'])} ms"
                )
    stores = results.get("stores")
    if stores:
        lines.append("")
        lines.append(f"fenced store writes against plain ones, 1 writer, {stores['writes']} each")
        for name, label in (("s3", "S3 object, 1 KiB"), ("redis", "Redis key")):
            row = stores.get(name, {})
            if "skipped" in row:
                lines.append(f"{label:<18} skipped ({row['skipped']})")
            elif row:
                lines.append(
                    f"{label:<18} plain p50 {_ms(row['plain_p50_ms'])} ms, "
                    f"p90 {_ms(row['plain_p90_ms'])} ms; "
                    f"fenced p50 {_ms(row['fenced_p50_ms'])} ms, p90 {_ms(row['fenced_p90_ms'])} ms; "
                    f"x plain {_ratio(row['fenced_over_plain'])}"
                )
    return "\n".join(lines) + "\n"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _us(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def chart(results: dict[str, Any], path: str) -> None:
    """Throughput and p99 latency against client count, many keys and the hot key."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cycles = results["cycles"]
    figure, axes = plt.subplots(2, 2, figsize=(11, 8), sharex=True)
    for column, workload in enumerate(("many_keys", "hot_key")):
        for name, series in cycles[workload].items():
            clients = [row["clients"] for row in series]
            axes[0][column].plot(
                clients, [row["ops_per_s"] for row in series], marker="o", label=name
            )
            axes[1][column].plot(
                clients, [row["p99_ms"] or 0 for row in series], marker="o", label=name
            )
        axes[0][column].set_title(f"acquire + release, {workload.replace('_', ' ')}")
        axes[0][column].set_ylabel("cycles / s")
        axes[1][column].set_ylabel("p99 latency (ms)")
        axes[1][column].set_xlabel("client processes")
        axes[1][column].set_xscale("log", base=2)
        axes[0][column].legend(fontsize="small")
    info = results["machine"]
    figure.suptitle(
        f"coordination_bench: {info['database']} {info.get('postgresql', info.get('mariadb', ''))}, "
        f"{info['cpus']} CPUs, {'quick run' if results.get('quick') else 'full run'}"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)
