908 /opt/torch/.venv/bin/python3 -u -m rlslurm.trainer.main --run-dir /tmp/rlslurm-gpu-defaults/test_colocated_demo_with_defau0/run 
1267 sglang::scheduler                                                                                                                                 
2212 sglang::scheduler                                                                                                                                 
3060 /opt/torch/.venv/bin/python3 -u -m rlslurm.trainer.main --run-dir /tmp/rlslurm-gpu-qwen3/test_family_trains_colocated_w0/run 
3403 sglang::scheduler                                                                                                                                 
