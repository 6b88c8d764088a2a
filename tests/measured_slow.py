"""Tests outside tests/e2e that are too slow for the fast tier: marked ``slow`` by tests/conftest.py.

Measured with ``pytest --durations=0`` over the whole suite on the 2-core box, shared with other test runs at the
time (load 2 to 16, so times were inflated about 1.5-3x): a test is here when its own call took more than
SLOW_SECONDS (a fixture set up once for a whole module or session is not charged to one test). Most of these wait on
a deadline on purpose, or start processes and engines of their own. Keyed by file name, then test function name
(every parametrisation of it). Seconds as measured, for the next re-measurement to compare.
"""

SLOW_SECONDS = 5.0

MEASURED_SLOW: dict[str, frozenset[str]] = {
    "test_episodes.py": frozenset({
        "test_sleeping_environment_does_not_stall_other_groups",  # 6.2 s: its environment sleeps 3 x 2 s on purpose
    }),
    "test_engine_alone.py": frozenset({
        "test_keep_full_decodes_every_slot_at_every_step_until_the_prompts_run_out",  # 8.2 s: 600 sequences (load ~6)
    }),
    "test_pipeline_limit.py": frozenset({
        "test_learner_alone_trains_whole_batches_in_ticket_order_and_refuses_too_few_groups",  # 12.6 s (load ~5)
    }),
    "test_skyrl_gym.py": frozenset({
        "test_gsm8k_multi_turn_on_the_vllm_engine",  # 18.9 s: starts its own vLLM engine (load ~7)
    }),
    "test_selftest_bare.py": frozenset({
        "test_selftest_runs_without_the_launch_stack",  # ~15 s: builds a model, starts an engine process
    }),
    "test_checkpoint_sharded.py": frozenset({
        "test_two_rank_checkpoint_round_trip_is_bit_exact",  # 24.8 s
    }),
    "test_data_warmstart.py": frozenset({
        "test_warmstart_improves_heldout_accuracy",  # 15.4 s
    }),
    "test_lora_push.py": frozenset({
        "test_adapter_push_bytes_and_engines_generate_with_the_merged_adapter",  # 24.1 s
    }),
    "test_sync_engine.py": frozenset({
        "test_tied_float32_model_gets_its_output_layer_updated",  # 14.8 s
        "test_push_updates_a_running_vllm_engine_layer_group_by_layer_group",  # 14.5 s
    }),
    "test_engine.py": frozenset({
        "test_vllm_tied_fp32_update_refreshes_output_layer",  # 13.0 s
    }),
    "test_auth.py": frozenset({
        "test_a_client_without_the_keys_can_neither_push_nor_take_a_ticket_nor_read_control",  # 9.1 s
    }),
    "test_sync_broadcast.py": frozenset({
        "test_unreachable_store_names_the_address_and_respects_the_timeout",  # 6.9 s
    }),
    "test_sync_fanout.py": frozenset({
        "test_a_member_that_does_not_take_a_push_is_named_within_the_timeout",  # 6.8 s
        "test_a_stopped_member_misses_the_push_deadline_and_the_others_are_served_in_time",  # 5 s deadline + spawns
        "test_an_overdue_push_is_retired_without_waiting_while_the_learner_waits_for_a_batch",  # 9.4 s: 3 s deadline
        "test_a_killed_member_breaks_nobody_and_its_replacement_gets_the_current_weights",  # 6.0 s (fast tier, 2026-11-30)
    }),
    "test_learner_distributed.py": frozenset({
        "test_init_learner_group_times_out_with_a_clear_error",  # 6.3 s
    }),
    "test_data_reverse.py": frozenset({
        "test_builtin_tiny_reverse_builds_and_loads",  # 5.4 s
    }),
    "test_moe_push.py": frozenset({
        "test_tiny_moe_builtin_is_a_top2_of_8_mixture_and_its_warm_start_beats_chance",  # 32.8-46.7 s (load ~6-9)
        "test_expert_push_reaches_vllm_packed_experts_and_the_hf_engine",  # 25.1-30.0 s: vLLM engine in a child
        "test_a_save_pretrained_moe_directory_loads_in_learner_and_both_engines",  # 13.6-21.8 s: the same
    }),
    # the fast tier of 2026-11-30 (`pytest -m "not slow" --durations=80`, 10 min 22 s on the I/O-starved box, nothing
    # else running); the calls above 5 s moved here (their whole-suite row in tests/README.md)
    "test_moe_routing_replay.py": frozenset({
        "test_vllm_records_every_position_as_the_learner_would_route_it",  # 30.3 s: a vLLM engine of its own
    }),
    "test_bench_quick_smoke.py": frozenset({
        "test_quick_reruns_the_two_cheapest_benchmarks_beside_the_committed_figures",  # 22.1 s
    }),
    "test_moe_sharded.py": frozenset({
        "test_two_fsdp_ranks_with_routing_replay_equal_one_rank",  # 13.6 s: two spawned gloo ranks
    }),
    "test_staleness_regrants.py": frozenset({
        "test_skips_and_pushes_every_few_versions_never_stall_drop_or_train_past_the_bound",  # 3.3-11.8 s x 4
    }),
    "test_staleness_lookahead.py": frozenset({
        "test_out_of_order_consumption_never_trains_past_the_bound",  # 4.0-7.3 s x 3
    }),
    "test_staleness_moving_window.py": frozenset({
        "test_every_token_stays_within_its_own_tickets_k_while_the_window_moves",  # 5.9 s
    }),
    "test_window_tuner.py": frozenset({
        "test_a_clear_climb_leaps_whole_rungs_and_gets_there_sooner",  # 5.3-6.5 s: four simulated 60-step runs
    }),
    "test_envs_policy.py": frozenset({
        "test_launch_refuses_an_unknown_env_before_starting_ray",  # 5.3 s: a launch process
    }),
}
