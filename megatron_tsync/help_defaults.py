"""The defaults ``--help`` shows, as data: ``TrainConfig().to_dict()`` of this version, so that printing help imports
neither torch nor megatron (the sections owned by torch-importing modules are only built for a run).

Regenerate after changing a default: ``python -m megatron_tsync.help_defaults`` (rewrites this file);
``tests/test_arguments.py`` fails while it is out of date.
"""

DEFAULTS = {'checkpoint': {'exit_duration_in_mins': None,
                'finetune': False,
                'keep_last': None,
                'load': None,
                'load_fallback': False,
                'override_loaded_config': False,
                'save': None,
                'save_interval': None},
 'learner': {'accumulate_on_host': False,
             'aux_strategy': 'second-backward',
             'bucket_device_gib': None,
             'bucket_host_gib': None,
             'coalesce_ms': 0.0,
             'coalesce_tokens': 0,
             'deterministic': False,
             'dp_assignment': 'auto',
             'epochs': 1,
             'estimator': 'grpo',
             'estimator_eps': 1e-06,
             'full_microbatches': False,
             'loss': {'aggregation': 'token-mean',
                      'entropy_coef': 0.0,
                      'kl_coef': 0.0,
                      'kl_kind': 'k3',
                      'kl_mode': 'none',
                      'old_logprobs': 'trainer',
                      'policy': {'clip_high': 0.2,
                                 'clip_low': 0.2,
                                 'dual_clip': None,
                                 'kind': 'ppo_clip',
                                 'tis_cap': None},
                      'temperature': 1.0},
             'max_device_buckets': None,
             'max_open_groups': None,
             'max_packed_tokens': 4096,
             'mode': 'stream-trajectory',
             'num_minibatches': 1,
             'pack_across_groups': False,
             'poll_timeout_s': 0.05,
             'reward_spec': {'hi': 1.0, 'kind': 'binary', 'lo': 0.0},
             'sequence_packing': False,
             'shared_prefix': False,
             'skip_zero_advantage': True,
             'wait_for_variance': True},
 'logging': {'dump_grads': None,
             'dump_rollouts': None,
             'eval_greedy': True,
             'eval_interval': 0,
             'eval_prompts': 128,
             'log_interval': 1,
             'progress': True,
             'replay_rollouts': None,
             'replay_shuffle_seed': None,
             'stop_on_no_signal': 0,
             'tensorboard_dir': None,
             'wandb_exp_name': None,
             'wandb_project': None,
             'wandb_save_dir': None},
 'model': {'init_tiny_model': False,
           'moe_aux_loss_coeff': 0.0,
           'moe_router_replay': False,
           'path': None,
           'recompute_granularity': None,
           'recompute_method': None,
           'recompute_num_layers': None,
           'ref_model': None,
           'sft_warmup_lr': None,
           'sft_warmup_steps': 0,
           'tiny_model_family': 'llama'},
 'optim': {'adam_beta1': 0.9,
           'adam_beta2': 0.999,
           'adam_eps': 1e-08,
           'clip_grad': 1.0,
           'lr': 1e-05,
           'optimizer': 'adam',
           'sgd_momentum': 0.0,
           'use_distributed_optimizer': False,
           'weight_decay': 0.0},
 'parallel': {'context_parallel_size': 1,
              'expert_model_parallel_size': 1,
              'pipeline_model_parallel_size': 1,
              'tensor_model_parallel_size': 1,
              'trainer_cpus': None,
              'use_distributed_optimizer': False},
 'precision': {'bf16': False, 'fp8_format': None, 'fp8_recipe': 'delayed', 'params_dtype': 'float32'},
 'rl': {'algorithm': 'grpo',
        'group_size': 8,
        'groups_per_step': 4,
        'max_consecutive_skipped_steps': 3,
        'max_new_tokens': 64,
        'max_staleness': 0,
        'max_turns': 4,
        'opd_objective': 'sampled',
        'seed': 1234,
        'seq_length': 1024,
        'train_iters': 100},
 'rollout': {'cpus': None,
             'endpoint': None,
             'engine': 'embedded',
             'engine_tensor_parallel_size': 1,
             'frontier_first': False,
             'gpus': None,
             'harness_chat_format': 'model',
             'harness_cmd': None,
             'harness_fn': None,
             'harness_timeout_s': 300.0,
             'heartbeat_timeout_s': 60.0,
             'latency_profile': 'none',
             'latency_scale': 1.0,
             'launch': 'local',
             'max_num_seqs': 0,
             'num_workers': 1,
             'run_dir': None,
             'sandbox_timeout_s': 10.0,
             'secret_file': None,
             'speculative': False,
             'speculative_draft_tokens': 0,
             'stall_timeout_s': 1800.0,
             'task': 'arithmetic-calculator',
             'tau2_keep_trivial_tasks': False,
             'teacher_model': None,
             'temperature': 1.0,
             'top_k': 0,
             'top_p': 1.0,
             'verifier': 'exact_answer',
             'weight_sync': 'file',
             'weight_sync_bucket_mb': 256,
             'worker_retries': 2}}


def current() -> dict:
    """The live defaults (imports torch)."""
    from megatron_tsync.config import TrainConfig

    return TrainConfig().to_dict()


def main() -> None:
    import pprint

    path = __file__
    with open(path) as f:
        text = f.read()
    head, _, tail = text.partition("DEFAULTS = ")
    tail = tail[tail.index("\n\n\ndef current"):]
    body = pprint.pformat(current(), width=116, sort_dicts=True)
    with open(path, "w") as f:
        f.write(f"{head}DEFAULTS = {body}{tail}")


if __name__ == "__main__":
    main()
