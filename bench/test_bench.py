#!/usr/bin/python3
"""Tests of how the bench scripts count and report: a wrong count here would put a wrong
figure beside a target, so the arithmetic is checked against results worked out by hand
(Little's law among them). Run by scripts/test.sh:

    /usr/bin/python3 -m unittest discover -s bench -p 'test_*.py'
"""

import os
import tempfile
import unittest

import ab
import bench
import sections


def fio_job(read_ios=0, write_ios=0, runtime_ms=3000, lat_us=100.0, sync_ios=0, sync_lat_us=0.0, error=0):
    """One job of fio's JSON report, with only the fields the bench reads."""

    def direction(ios):
        seconds = runtime_ms / 1000
        return {"total_ios": ios, "iops": ios / seconds if ios else 0.0, "io_bytes": ios * 4096,
                "bw_bytes": ios * 4096 / seconds if ios else 0.0, "runtime": runtime_ms if ios else 0,
                "lat_ns": {"mean": lat_us * 1000 if ios else 0.0}}

    job = {"error": error, "read": direction(read_ios), "write": direction(write_ios)}
    if sync_ios:
        job["sync"] = {"total_ios": sync_ios, "lat_ns": {"mean": sync_lat_us * 1000}}
    return job


class FioTotals(unittest.TestCase):
    def test_one_job_is_its_own_rate(self):
        total = bench.fio_totals([fio_job(read_ios=300_000, lat_us=125.0)])
        self.assertEqual(total["ios"], 300_000)
        self.assertAlmostEqual(total["iops"], 100_000)
        self.assertAlmostEqual(total["mbps"], 100_000 * 4096 / 1e6)
        self.assertAlmostEqual(total["lat_us"], 125.0)
        self.assertAlmostEqual(total["runtime_s"], 3.0)
        self.assertIsNone(total["start_spread_ms"])

    def test_jobs_without_windows_are_summed(self):
        jobs = [fio_job(read_ios=100_000), fio_job(read_ios=200_000)]
        self.assertAlmostEqual(bench.fio_totals(jobs)["iops"], 100_000)

    def test_jobs_that_ran_at_different_times_are_counted_over_their_span(self):
        # Two jobs of 3 s each, the second started 3 s after the first: each job's own rate
        # is 100k, but over the 6 s in which they ran the server did 600k requests, 100k/s.
        # Summing the jobs' rates would claim 200k, twice what was delivered.
        jobs = [fio_job(read_ios=300_000), fio_job(read_ios=300_000)]
        windows = [(1000.0, 1003.0), (1003.0, 1006.0)]
        total = bench.fio_totals(jobs, windows)
        self.assertAlmostEqual(total["iops"], 100_000)
        self.assertAlmostEqual(total["runtime_s"], 6.0)
        self.assertAlmostEqual(total["mbps"], 600_000 * 4096 / 6 / 1e6)
        self.assertAlmostEqual(total["start_spread_ms"], 3000)

    def test_the_span_agrees_with_littles_law(self):
        # 4 jobs x 32 in flight, each at 128 us per request over the same 2 s window: by
        # Little's law 128 in flight / 128 us = 1M requests a second in all.
        jobs = [fio_job(read_ios=500_000, runtime_ms=2000, lat_us=128.0) for _ in range(4)]
        windows = [(50.0 + i * 0.001, 52.0 + i * 0.001) for i in range(4)]
        total = bench.fio_totals(jobs, windows)
        in_flight = total["iops"] * total["lat_us"] / 1e6
        self.assertAlmostEqual(in_flight, 128, delta=0.5)
        self.assertAlmostEqual(total["start_spread_ms"], 3, places=6)

    def test_a_job_with_no_window_is_left_out_of_the_span(self):
        jobs = [fio_job(read_ios=200_000, runtime_ms=2000), fio_job(read_ios=0, runtime_ms=2000)]
        total = bench.fio_totals(jobs, [(10.0, 12.0), None])
        self.assertAlmostEqual(total["iops"], 100_000)
        self.assertEqual(total["start_spread_ms"], 0)

    def test_no_dated_window_falls_back_to_the_sum(self):
        jobs = [fio_job(read_ios=100_000), fio_job(read_ios=100_000)]
        self.assertAlmostEqual(bench.fio_totals(jobs, [None, None])["iops"], 200_000 / 3)

    def test_latency_is_the_mean_over_requests_not_over_jobs(self):
        jobs = [fio_job(read_ios=300_000, lat_us=100.0), fio_job(read_ios=100_000, lat_us=500.0)]
        self.assertAlmostEqual(bench.fio_totals(jobs)["lat_us"], (300_000 * 100 + 100_000 * 500) / 400_000)

    def test_writes_and_their_syncs(self):
        total = bench.fio_totals([fio_job(write_ios=9_000, lat_us=80.0, sync_ios=9_000, sync_lat_us=40.0)])
        self.assertAlmostEqual(total["iops"], 3_000)
        self.assertAlmostEqual(total["lat_us"], 80.0)
        self.assertAlmostEqual(total["sync_lat_us"], 40.0)

    def test_a_job_error_is_raised(self):
        with self.assertRaisesRegex(RuntimeError, "fio job error 5"):
            bench.fio_totals([fio_job(read_ios=1, error=5)])


class FioJobWindows(unittest.TestCase):
    def test_windows_are_dated_from_each_jobs_first_log_entry(self):
        with tempfile.TemporaryDirectory() as tmp:
            prefix = os.path.join(tmp, "jobs")
            # fio's iops log with --log_unix_epoch: "msec, value, direction, bs, ..."; the
            # first entry closes the first 100 ms interval after the ramp.
            with open(f"{prefix}_iops.1.log", "w") as f:
                f.write("1700000000100, 31000, 0, 4096, 0\n1700000000200, 32000, 0, 4096, 0\n")
            with open(f"{prefix}_iops.2.log", "w") as f:
                f.write("\n1700000003100, 30000, 0, 4096, 0\n")
            open(f"{prefix}_iops.3.log", "w").close()  # a job that did no I/O
            # job 4 wrote no log at all
            jobs = [fio_job(read_ios=1, runtime_ms=2000) for _ in range(4)]
            windows = bench.fio_job_windows(prefix, jobs)
        self.assertEqual(len(windows), 4)
        self.assertAlmostEqual(windows[0][0], 1_700_000_000.0)
        self.assertAlmostEqual(windows[0][1], 1_700_000_002.0)
        self.assertAlmostEqual(windows[1][0], 1_700_000_003.0)
        self.assertIsNone(windows[2])
        self.assertIsNone(windows[3])
        total = bench.fio_totals(jobs, windows)
        self.assertAlmostEqual(total["runtime_s"], 5.0)
        self.assertAlmostEqual(total["start_spread_ms"], 3000)

    def test_the_log_options_name_the_prefix_the_windows_read(self):
        args = bench.fio_window_args("/x/jobs")
        self.assertIn("--write_iops_log=/x/jobs", args)
        self.assertIn(f"--log_avg_msec={bench.WINDOW_LOG_MSEC}", args)
        self.assertIn("--log_unix_epoch=1", args)


class Report(unittest.TestCase):
    def test_start_spread_lines_name_only_multi_job_rows(self):
        selected = {"randread-qd32": ([], ["netblk-mem"]), "randread-4x32": ([], ["netblk-mem", "nbdkit-file"])}
        results = {("randread-qd32", "netblk-mem"): [{"start_spread_ms": None}],
                   ("randread-4x32", "netblk-mem"): [{"start_spread_ms": 2.0}, {"start_spread_ms": 5.0},
                                                     {"start_spread_ms": 3.0}],
                   ("randread-4x32", "nbdkit-file"): [{"start_spread_ms": 40.0}, {"start_spread_ms": 3040.0},
                                                      {"start_spread_ms": 10.0}]}
        text = "".join(bench.start_spread_lines(selected, results))
        self.assertIn("randread-4x32 netblk-mem 3 (5)", text)
        self.assertIn("randread-4x32 nbdkit-file 40 (3,040)", text)
        self.assertNotIn("qd32", text)
        self.assertEqual(bench.start_spread_lines({"randread-qd32": ([], ["netblk-mem"])}, {}), [])

    def test_median_range_skips_missing_values(self):
        self.assertEqual(bench.median_range([3, None, 1, 2]), (2, 1, 3))
        self.assertEqual(bench.median_range([None]), (None, None, None))

    def test_disk_queue_depth_is_time_in_queue_over_time(self):
        # 24 requests at the disk for 2 s: 48,000 ms of queue time summed over them.
        self.assertAlmostEqual(bench.disk_queue_depth((10.0, 5_000), (12.0, 53_000)), 24.0)
        self.assertIsNone(bench.disk_queue_depth(None, (12.0, 53_000)))
        self.assertIsNone(bench.disk_queue_depth((12.0, 5_000), (12.0, 5_000)))

    def test_disk_reading_takes_the_queue_time_field(self):
        # A /sys/block/*/stat line: reads, merges, sectors, ms; the same for writes; in flight,
        # io ms, time in queue ms (the 11th field), then discards and flushes.
        with tempfile.NamedTemporaryFile("w", suffix="stat") as f:
            f.write("  1000 0 8000 400 200 0 1600 90 3 2000 4567 0 0 0 0 0 0\n")
            f.flush()
            when, in_queue = bench.disk_reading(f.name)
        self.assertEqual(in_queue, 4567)
        self.assertIsNone(bench.disk_reading(None))

    def test_disk_stat_path_names_a_stat_file_or_none(self):
        for path in ("/var/tmp", "/dev/shm", "/proc/self"):
            stat = bench.disk_stat_path(path)
            self.assertTrue(stat is None or (os.path.exists(stat) and stat.endswith("/stat")), (path, stat))
        # /proc has no disk under it.
        self.assertIsNone(bench.disk_stat_path("/proc/self"))

    def test_sizes(self):
        self.assertEqual(bench.size_bytes("64k"), 64 << 10)
        self.assertEqual(bench.size_bytes("32m"), 32 << 20)

    def test_other_scripts_sections_survive_a_new_report(self):
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "RESULTS.md")
            with open(path, "w") as f:
                f.write("# old table\n\n<!-- flush:begin -->\nflush figures\n<!-- flush:end -->\n\n"
                        "<!-- fs:begin -->\nold fs\n<!-- fs:end -->\n")
            kept = bench.kept_sections(path, {"fs": "<!-- fs:begin -->\nnew fs\n<!-- fs:end -->"})
            text = "\n".join(kept)
            self.assertIn("flush figures", text)
            self.assertIn("new fs", text)
            self.assertNotIn("old fs", text)
            self.assertNotIn("old table", text)

    def test_replace_sections_changes_nothing_else(self):
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "RESULTS.md")
            with open(path, "w") as f:
                f.write("# table\n\nrow\n\n<!-- fs:begin -->\nold fs\n<!-- fs:end -->\n\ntail\n")
            bench.replace_sections(path, {"fs": "<!-- fs:begin -->\nnew\n<!-- fs:end -->",
                                          "replication": "<!-- replication:begin -->\nr\n<!-- replication:end -->"})
            text = sections.read_text(path)
        self.assertTrue(text.startswith("# table\n\nrow\n\n<!-- fs:begin -->\nnew\n<!-- fs:end -->\n\ntail\n"))
        self.assertTrue(text.endswith("<!-- replication:begin -->\nr\n<!-- replication:end -->\n"))

    def test_write_section_replaces_in_place_or_appends(self):
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "RESULTS.md")
            sections.write_section(path, "flush", "first")
            sections.write_section(path, "replication", "second")
            sections.write_section(path, "flush", "third")
            text = sections.read_text(path)
        self.assertEqual(text.count("<!-- flush:begin -->"), 1)
        self.assertIn("<!-- flush:begin -->\nthird\n<!-- flush:end -->", text)
        self.assertLess(text.index("third"), text.index("second"))


class Targets(unittest.TestCase):
    """The targets section judges every row the issue names (review, session 66)."""

    def report(self, rows):
        import argparse
        import unittest.mock
        selected = {name: ([], ["netblk-mem", "nbdkit-mem"]) for name, _ in rows}
        results = {}
        for name, (ours, theirs) in rows:
            for server, (iops, cpu) in (("netblk-mem", ours), ("nbdkit-mem", theirs)):
                results[(name, server)] = [{"iops": iops, "cpu_per_mreq": cpu, "lat_us": 1e6 / iops,
                                            "mbps": iops * 4096 / 1e6, "tcp": {}, "steal": 0.0}]
        args = argparse.Namespace(quick=True, steal_limit=10.0)
        with tempfile.TemporaryDirectory() as tmp, unittest.mock.patch.object(bench, "ROOT", tmp):
            os.makedirs(os.path.join(tmp, "bench"))
            bench.write_report(args, selected, {}, results, {}, 1, 1, (1000.0, "test"), 60, 0)
            with open(os.path.join(tmp, "bench", "RESULTS-quick.md")) as f:
                return f.read()

    def test_every_4k_read_workload_and_write_cpu_are_judged(self):
        level = ((100_000, 3.0), (90_000, 10.0))
        rows = [(w, level) for w in bench.READ_4K_WORKLOADS if w != "randread-8x32"]
        rows += [("randread-8x32", ((50_000, 3.0), (100_000, 10.0))),  # loses 2:1
                 ("randwrite-qd32", ((100_000, 6.0), (90_000, 10.0)))]  # 0.6× the CPU
        text = self.report(rows)
        self.assertIn("| randread-8x32 IOPS ≥ nbdkit (mem) | 0.500× | FAIL |", text)
        self.assertIn("| curve-read-4k IOPS ≥ nbdkit (mem) | 1.111× | PASS |", text)
        self.assertIn("| nbdload-randread-qd256 IOPS ≥ nbdkit (mem) | 1.111× | PASS |", text)
        self.assertIn("| CPU per 4 KiB read at QD32 ≤ 0.5× nbdkit (mem) | 0.300× | PASS |", text)
        self.assertIn("| CPU per 4 KiB write at QD32 ≤ 0.5× nbdkit (mem) | 0.600× | FAIL |", text)

    def test_a_ratio_just_below_one_does_not_print_as_one(self):
        rows = [("randread-qd32", ((100_000, 3.0), (90_000, 10.0))),
                ("randread-qd256", ((99_700, 3.0), (90_000, 10.0)))]
        self.assertIn("| IOPS at QD256 ≥ IOPS at QD32 (mem) | 0.997× | FAIL |", self.report(rows))


class LocalRow(unittest.TestCase):
    def test_the_local_write_flush_row_syncs_data_as_a_flush_does(self):
        import unittest.mock
        seen = []

        def fake_run(argv, **_):
            seen.append(argv)
            raise RuntimeError("stop here")

        with unittest.mock.patch.object(bench.subprocess, "run", fake_run):
            with self.assertRaises(RuntimeError):
                bench.run_fio(["--rw=randwrite", "--fsync=1"], "/var/tmp/x.img", 1, "/tmp/out.json")
            with self.assertRaises(RuntimeError):
                bench.run_fio(["--rw=randwrite", "--fsync=1"], "nbd://127.0.0.1:1", 1, "/tmp/out.json")
        self.assertIn("--fdatasync=1", seen[0])
        self.assertNotIn("--fsync=1", seen[0])
        self.assertIn("--fsync=1", seen[1])


class RunOrder(unittest.TestCase):
    def test_rounds_interleave_across_fio_workloads_and_file_system_rows_come_last(self):
        selected = {"qd32": ([], ["a", "b"]), "qd256": ([], ["a", "b"])}
        fs_selected = {"fs": ([], ["a", "b"])}
        order = [(r, name, server) for r, name, _, server in bench.run_order(selected, fs_selected, 2, None)]
        self.assertEqual(order, [
            (0, "qd32", "a"), (0, "qd32", "b"), (0, "qd256", "a"), (0, "qd256", "b"),
            (1, "qd32", "a"), (1, "qd32", "b"), (1, "qd256", "a"), (1, "qd256", "b"),
            (0, "fs", "a"), (0, "fs", "b"), (1, "fs", "a"), (1, "fs", "b")])

    def test_only_the_chosen_servers_run(self):
        order = bench.run_order({"qd32": ([], ["a", "b"])}, {}, 1, ["b"])
        self.assertEqual([(name, server) for _, name, _, server in order], [("qd32", "b")])


def rounds_at(*steals):
    """A row's runs, one per steal share, their IOPS numbering them in the order they ran."""
    return [{"iops": i + 1, "steal": steal} for i, steal in enumerate(steals)]


class StealRounds(unittest.TestCase):
    def test_a_row_with_no_extra_rounds_is_kept_whole(self):
        runs = rounds_at(0.30, 0.01, 0.20)
        self.assertEqual(bench.quietest(runs, 3), runs)

    def test_the_quietest_rounds_are_kept_in_the_order_they_ran(self):
        runs = rounds_at(0.30, 0.01, 0.20, 0.02, 0.05)
        self.assertEqual([r["iops"] for r in bench.quietest(runs, 3)], [2, 4, 5])

    def test_a_tie_keeps_the_earlier_round_and_missing_steal_counts_as_none(self):
        runs = [{"iops": 1, "steal": 0.05}, {"iops": 2}, {"iops": 3, "steal": 0.05}, {"iops": 4, "steal": 0.5}]
        self.assertEqual([r["iops"] for r in bench.quietest(runs, 2)], [1, 2])

    def test_a_workload_is_noisy_while_any_rows_kept_rounds_exceed_the_limit(self):
        selected = {"qd32": ([], ["a", "b"]), "qd1": ([], ["a", "b"]), "seq": ([], ["a", "b"])}
        results = {("qd32", "a"): rounds_at(0.01, 0.02, 0.03), ("qd32", "b"): rounds_at(0.01, 0.12, 0.03),
                   ("qd1", "a"): rounds_at(0.01, 0.25, 0.03), ("qd1", "b"): rounds_at(0.0, 0.0, 0.0),
                   ("seq", "a"): rounds_at(0.01, 0.02, 0.03), ("seq", "b"): rounds_at(0.01, 0.02, 0.03)}
        self.assertEqual(bench.noisy_workloads(selected, results, 3, 0.10, None), ["qd1", "qd32"])
        # An extra round with little steal displaces the noisy one from the kept three.
        results[("qd32", "a")].append({"iops": 4, "steal": 0.0})
        results[("qd32", "b")].append({"iops": 4, "steal": 0.01})
        self.assertEqual(bench.noisy_workloads(selected, results, 3, 0.10, None), ["qd1"])

    def test_only_the_chosen_servers_decide(self):
        selected = {"qd32": ([], ["a", "b"])}
        results = {("qd32", "a"): rounds_at(0.5), ("qd32", "b"): rounds_at(0.0)}
        self.assertEqual(bench.noisy_workloads(selected, results, 1, 0.10, ["b"]), [])
        self.assertEqual(bench.noisy_workloads(selected, results, 1, 0.10, None), ["qd32"])

    def test_the_report_names_the_workloads_measured_again(self):
        self.assertEqual(bench.extra_round_lines({}, 3, 10), [])
        text = " ".join(bench.extra_round_lines({"randread-qd32": 2, "write-fsync-qd1": 1}, 3, 10))
        self.assertIn("more than 10% steal: randread-qd32 2 more, write-fsync-qd1 1 more", text)
        self.assertIn("its 3 rounds with the least steal", text)


class AbExtraRounds(unittest.TestCase):
    """`ab.py` measures a workload again, as bench.py does, while a kept round ran slowed."""

    def measure(self, steals, rounds=3, extra_rounds=3):
        """Runs rows a and b with the given steal per round (the last value repeats), and
        returns the extra rounds and the order of the calls."""
        results, calls = {}, []

        def run_row(r, row):
            calls.append((r, row))
            results.setdefault(("w", row), []).append({"iops": r, "steal": steals[min(r, len(steals) - 1)]})

        more = ab.measure_workload("w", ["a", "b"], rounds, run_row, results, 0.10, extra_rounds)
        return more, calls, results

    def test_quiet_rounds_get_no_more(self):
        more, calls, _ = self.measure([0.01, 0.02, 0.0])
        self.assertEqual(more, 0)
        self.assertEqual(calls, [(0, "a"), (0, "b"), (1, "a"), (1, "b"), (2, "a"), (2, "b")])

    def test_a_slowed_round_gets_every_row_once_more_until_the_kept_ones_are_quiet(self):
        more, calls, results = self.measure([0.01, 0.30, 0.25, 0.0])
        self.assertEqual(more, 2)
        self.assertEqual(calls[6:], [(3, "a"), (3, "b"), (4, "a"), (4, "b")])
        self.assertEqual([r["iops"] for r in bench.quietest(results[("w", "a")], 3)], [0, 3, 4])

    def test_extra_rounds_stop_at_the_limit_or_never_start(self):
        self.assertEqual(self.measure([0.5])[0], 3)
        self.assertEqual(self.measure([0.5], extra_rounds=0)[0], 0)




class OneRunAtATime(unittest.TestCase):
    """Two benchmark runs at once measured each other and restored each other's congestion
    control early (review, session 66): the second now stops at once, naming the first."""

    def test_a_second_run_is_refused_while_the_first_holds_the_lock(self):
        with tempfile.TemporaryDirectory() as scratch:
            saved = bench.BENCH_LOCK
            bench.BENCH_LOCK = os.path.join(scratch, "lock")
            try:
                with bench.one_run_at_a_time("first"):
                    with self.assertRaises(SystemExit) as refused:
                        with bench.one_run_at_a_time("second"):
                            self.fail("two runs held the lock")
                    self.assertIn("another benchmark is running (first, pid", str(refused.exception))
                # Released: the next run goes ahead.
                with bench.one_run_at_a_time("third"):
                    pass
            finally:
                bench.BENCH_LOCK = saved

if __name__ == "__main__":
    unittest.main()
