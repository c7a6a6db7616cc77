"""Every private Lightning or torch API the package uses, where, why, and what public hook could replace it.

Documentation only: nothing imports this module at run time. ``tests/test_private_api.py`` scans the package's
code (comments and docstrings left out) for private names of torch and Lightning objects and fails when a use is
missing here or an entry here is no longer used, so this list stays true. Paths are relative to
``lightning_tp2d/``; ``file:function`` names the function (or class) that holds the use.

Each entry: the API, **where** it is used, **why**, and the **public** hook that could replace it (or why none
exists). The ones a small public change could drop have been replaced.

Lightning (2.6)
---------------

``ModelParallelStrategy._configure_launcher`` (overridden; calls ``super()``)
    where: strategy.py:TP2DStrategy._configure_launcher
    why: the first strategy hook Lightning's accelerator connector calls once devices, nodes and the precision
    plugin are set and before any process is launched; precision and ``(p, dp)`` are checked there, so a bad size
    fails once, in the launching process.
    public: none. ``__init__`` runs before those are known; ``setup_environment`` runs after the launch, in every
    rank.

``ModelParallelStrategy._launcher`` (its ``launch`` wrapped on the instance)
    where: strategy.py:TP2DStrategy._configure_launcher
    why: the launcher Lightning made (``_SubprocessScriptLauncher``, when Lightning starts the local ranks) is the last
    code to run in the launching process alone with both the module and the data module in hand: the wrapped
    ``launch`` checks the data against the model and the layout first, so a mismatch fails once, not in every rank.
    The instance keeps its class (Lightning's Ctrl-C handling tests it with ``isinstance``).
    public: none; ``setup`` and the hooks after it run in every rank, after the launch.

``ModelParallelStrategy._setup_distributed``
    where: strategy.py:TP2DStrategy.setup_environment
    why: initialises the process group Lightning's way (world ranks, backend, timeout, ``device_id``) without the
    base ``setup_environment``, which would also build Lightning's own ``(data_parallel, tensor_parallel)`` mesh.
    public: none cheap. ``super().setup_environment()`` is public but builds a second mesh (sub-group creation on
    every rank) and needs the private sizes below set first.

``LightningModule._device_mesh``
    where: strategy.py:TP2DStrategy.setup_environment (write; the module reads the public ``device_mesh``)
    why: ``LightningModule.device_mesh`` is a read-only property; the strategy hands the mesh to the module exactly
    as Lightning's ``ModelParallelStrategy`` does.
    public: none for the write (no setter).

``LightningModule._trainer``
    where: module.py:CausalLMModule.configure_model, module.py:CausalLMModule.setup,
    module.py:CausalLMModule.configure_optimizers
    why: whether the module is attached to a Trainer (the public ``trainer`` property raises when it is not).
    public: ``try: self.trainer`` / ``except RuntimeError``: public, but no clearer.

``MixedPrecision.clip_gradients`` (replaced on the plugin instance by ``Precision.clip_gradients``)
    where: precision.py:allow_clipping_without_scaler (called by strategy.py:TP2DStrategy._install_gradient_clipping
    and module.py:CausalLMModule.on_fit_start)
    why: ``bf16-mixed`` has no gradient scaler, yet ``MixedPrecision.clip_gradients`` refuses any optimizer that could
    unscale inside its step (torch's fused AdamW), so bf16-mixed + ``gradient_clip_val`` failed at the first step.
    public: ``LightningModule.configure_gradient_clipping`` for one's own module only (not a user's module under the
    strategy). Not found by the scan (the attribute name has no underscore); listed for the reader.

ModelCheckpoint: _should_skip_saving_checkpoint, _monitor_candidates, _save_topk_checkpoint, _save_last_checkpoint
    where: callbacks.py:StepCheckpoint.save_now
    why: saves the final step when ``every_n_train_steps`` does not divide ``max_steps``, and the step a signal
    stopped training at (from the batch-end hook, so it resumes exactly), with Lightning's own "already saved" rule,
    monitor candidates and top-k / last bookkeeping.
    public: partly: Lightning 2.6's ``ModelCheckpoint.on_train_end`` saves ``last.ckpt`` itself when
    ``save_last=True``; the final step's top-k entry has no public hook.

``RichProgressBar._get_train_description`` (overridden)
    where: callbacks.py:ResumableRichProgressBar._get_train_description
    why: Lightning's writes ``Epoch {epoch}/{max_epochs - 1}`` whatever ``max_epochs`` is: ``Epoch 0/-2`` under
    ``max_epochs=-1``, tp2d-train's setting (steps, not epochs, end its runs).
    public: none; the description is not an argument of the bar.

``_TrainingEpochLoop._broadcast_sigterm_tensor = ...`` (replaced on the instance)
    where: callbacks.py:GracefulInterrupt.on_train_start
    why: Lightning 2.6 broadcasts ``trainer.received_sigterm`` from rank 0 before every training batch and reads it
    with ``.item()``: a collective and a host sync per step. ``GracefulInterrupt`` replaces the handler that sets the
    flag (on every rank), so the broadcast can only say "no"; its own vote carries SIGTERM a step late instead.
    public: none; the broadcast runs in every distributed fit, with no switch.

``Precision.clip_grad_by_norm = ...``, ``Precision.clip_grad_by_value = ...`` (replaced on the instance)
    where: strategy.py:TP2DStrategy._install_gradient_clipping
    why: ``Trainer(gradient_clip_val=...)`` clips through the precision plugin, whose own methods see only local
    shards; the norm must span the mesh.
    public: none cheap. ``LightningModule.configure_gradient_clipping`` is the user's hook; a subclass would have
    to wrap each plugin class (``Precision``, ``MixedPrecision``, ``HalfPrecision``).

``_SubprocessScriptLauncher.launch`` (wrapped on the instance), ``_SubprocessScriptLauncher.procs`` (emptied)
    where: supervise.py:RankWatch.take_over, supervise.py:RankWatch.adopt (``tp2d-train`` only)
    why: Lightning's child-process observer polls the ranks every 5 s and SIGKILLs every process, the launching one
    included, when one has exited non-zero, so a dead rank ended the job with 137 or 1 depending on timing. The
    launching process adopts the ranks right after they start and empties the launcher's list, which the observer
    holds: it then sees no rank and stops. Relies on the observer holding that very list (Lightning 2.6).
    public: none; the observer has no switch. Not found by the scan (public names); listed for the reader.

Lightning Fabric (2.6): the same base-class internals as the Trainer strategy's, in Fabric's ``ModelParallelStrategy``

``lightning.fabric.strategies.ModelParallelStrategy._configure_launcher`` (overridden; calls ``super()``)
    where: fabric.py:TP2DFabricStrategy._configure_launcher
    why: Fabric's connector calls it once devices, nodes and precision are known, before processes are launched:
    precision and ``(p, dp)`` fail there once, in the launching process.
    public: none (``__init__`` runs before those are known).

``lightning.fabric.strategies.ModelParallelStrategy._setup_distributed``
    where: fabric.py:TP2DFabricStrategy.setup_environment
    why: the process group Lightning's way (ranks, backend, timeout, ``device_id``), without the base
    ``setup_environment``'s own ``(data_parallel, tensor_parallel)`` mesh.
    public: none cheap (as for the Trainer strategy).

``lightning.fabric.strategies.strategy._BackwardSyncControl``, ``Strategy._backward_sync_control``
    where: fabric.py:_GradientSyncControl, fabric.py:TP2DFabricStrategy._init_state
    why: ``fabric.no_backward_sync(model)`` asks the strategy's ``_backward_sync_control`` (an instance of this
    interface) for the context that skips gradient synchronisation; ours pauses the data-parallel buckets.
    public: none: it is the interface Fabric's own strategies implement.

torch (2.13)
------------

``torch.distributed.tensor.placement_types._StridedShard``
    where: nn/linear.py:_out_shard, nn/ring.py:RingLinear.__init__, checkpoint.py:box_view,
    checkpoint.py:_strided_over_dp_only, fsdp.py:_dp_shard_dim, fsdp.py:_stage0_only
    why: a rank's block of GPT-2's fused ``c_attn`` weight is three row blocks ``[q_i; k_i; v_i]``; this is the one
    DTensor placement that describes it, so ``full_tensor()`` is the plain parameter and DCP can reshard it.
    fsdp.py reads it to keep FSDP's data-parallel cut off such a strided dim (no placement describes that cut) and
    to store such parameters in their stage-0 form in checkpoints; checkpoint.py recognises FSDP's own strided cut
    over ``data_parallel`` (a row box DCP computes) to save it without a gather.
    public: none. ``Shard(0)`` needs the rows permuted (as the 1-D baseline does), which changes what
    ``full_tensor()`` and checkpoints hold.

``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu``
    where: metp.py:block_kernel, metp.py:_fused_forward, baselines/context_parallel.py:(module)
    why: the CPU flash-attention kernel also returns the log-sum-exp, which the ring's online-softmax merge needs;
    baselines/context_parallel.py gives torch's own context-parallel ring this op (and its backward) as the block op.
    public: none. ``F.scaled_dot_product_attention`` returns the output only (``flex_attention`` can return the
    log-sum-exp but is fast only under ``torch.compile``).

``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward``
    where: metp.py:_fused_backward, baselines/context_parallel.py:(module)
    why: the block backward from the *global* output and log-sum-exp, as torch's own context-parallel ring
    attention calls its flash backward.
    public: none.

``torch._scaled_mm``
    where: float8.py:TensorwiseGemm._scaled, planning/trace.py:(module)
    why: the float8 GEMM with per-operand scales that every float8 training recipe runs on (torchao's
    ``Float8Linear`` calls it too; the rowwise path reaches it through torchao's ``addmm_float8_unwrapped``). The
    tensorwise SUMMA partials call it directly, on float8 blocks that travelled the grid with the global scales. The
    cost model's tracer counts its FLOPs and makes its output from its shape (``torch.ops.aten._scaled_mm``: fake
    tensors have no CPU kernel for it).
    public: none in torch (``torch._scaled_mm`` is the only float8 GEMM); torchao wraps it in its tensor subclass,
    which the layouts' own communication cannot carry.

``torch.ops.aten._scaled_dot_product_flash_attention``, ``torch.ops.aten._scaled_dot_product_efficient_attention``,
``torch.ops.aten._scaled_dot_product_cudnn_attention``,
``torch.ops.aten._scaled_dot_product_flash_attention_backward``,
``torch.ops.aten._scaled_dot_product_efficient_attention_backward``,
``torch.ops.aten._scaled_dot_product_cudnn_attention_backward``
    where: metp.py:_fused_forward, metp.py:_fused_backward
    why: the CUDA fused kernels that return the log-sum-exp (cuDNN on Hopper and newer, flash for fp16/bf16,
    memory-efficient otherwise) and take the global output and log-sum-exp in the backward, as torch's own
    context-parallel ring attention calls them. Checked once per process against the math kernel before use
    (metp.py:_check_kernel). flash ran on an H200 on 2026-12-04 (recipes/results/gpu_issue12_h200.json); cuDNN's
    calls are checked on the meta device only (no GPU in CI).
    public: none, as for the CPU kernel.

``DTensor._op_dispatcher._custom_op_handlers``, ``torch.ops.aten._log_softmax``
    where: baselines/tp1d.py:_loss_parallel_active
    why: whether torch's ``loss_parallel()`` handlers are installed now (keyed by the ops it replaces): entering
    it again and leaving would remove the caller's handlers.
    public: none; ``loss_parallel`` exposes no state.

``torch.distributed.tensor.experimental._context_parallel._attention`` (``_templated_ring_attention``,
``_templated_ring_attention_backward``, its handler table ``custom_ops``)
    where: baselines/context_parallel.py:_ring_forward, baselines/context_parallel.py:_ring_backward,
    baselines/context_parallel.py:cpu_ring_attention
    why: the CPU baseline runs torch's own context-parallel ring attention (schedule, causal blocks, log-sum-exp
    merge, rotation) with the CPU flash kernel as its block op; torch 2.13 maps only the CUDA fused kernels to it.
    The handler for the CPU op goes into ``custom_ops``, which ``context_parallel`` merges into DTensor's dispatcher
    on entry, and is removed on exit.
    public: none; ``context_parallel`` takes no attention op and fails on CPU (no sharding strategy).

``torch.distributed.tensor.experimental._context_parallel._sharding_rules._op_strategy_context``,
``torch.distributed.tensor._ops.utils.expand_to_full_mesh_op_strategy``
    where: baselines/context_parallel.py:cpu_ring_attention, baselines/context_parallel.py:_forward_strategy,
    baselines/context_parallel.py:_backward_strategy
    why: the sequence-sharded (``Shard(2)``) sharding strategy of the CPU flash op and its backward, registered for a
    block and restored after it with the helper torch's CP uses for the CUDA ops.
    public: none; DTensor has no public strategy registration.

``DTensor._op_dispatcher``
    where: baselines/context_parallel.py:_cpu_sdpa_handler
    why: the CPU twin of torch's ``_sdpa_handler``: unwrap the DTensor arguments, propagate their sharding, wrap the
    ring's local results, as torch's CP handler does through the same dispatcher.
    public: none (custom op handlers are internal to DTensor).

``torch._subclasses.fake_tensor.FakeTensor``, ``torch._subclasses.fake_tensor.FakeTensorMode``
    where: bench/collectives.py:_shape_only, planning/live.py:_storage_key, planning/live.py:LiveTensorBytes,
    planning/memory_model.py:_shards_here, planning/trace.py:_run_here
    why: DTensor's shape propagation runs ops on fake tensors, which are neither allocations nor communication;
    the schedule tracer runs the parallel model on fake tensors, without memory or compute; the memory model
    reads the local shard shapes from the model built on them.
    public: none; torch documents fake tensors but exports them only from ``torch._subclasses``.

``torch.utils._python_dispatch.TorchDispatchMode``
    where: bench/collectives.py:FunctionalCollectiveCounter, planning/live.py:LiveTensorBytes,
    bench/measure.py:HostSyncCounter, planning/trace.py:_Recorder, comm_record.py:_direct_collectives,
    bench/layer_cost.py:OpCounter (the ops and memory-bound bytes of a training step)
    why: sees every aten op: counts functional collectives with their bytes, tracks live tensor bytes, counts the ops
    that make the host wait for the device, records the traced schedule; sees the ``c10d`` ops of the
    ``torch.distributed`` collectives FSDP2 issues without ``comm.py`` (so ``count_comm`` and the tracer see them).
    public: none for bytes. ``torch.distributed.tensor.debug.CommDebugMode`` counts collective calls but not
    their bytes, and nothing tracks live bytes. A ``TorchFunctionMode`` (public) sees ``dist.all_gather_single``
    itself, but it is switched off inside every function it handles, ``Tensor.backward`` included, so it would miss
    FSDP's backward all-gathers and reduce-scatters. FSDP's ``set_custom_all_gather`` / ``set_custom_reduce_scatter``
    would need every model wrapped with counting collectives.

``c10d`` op names ``_allgather_base_``, ``_reduce_scatter_base_`` (matched as strings)
    where: comm_record.py:_C10D_CALLS
    why: the native ops ``dist.all_gather_single`` and ``dist.reduce_scatter_single`` issue (what FSDP2 calls on
    CPU/gloo and on the fake process group); the table maps each ``c10d`` op to its kind and payload argument.
    public: the ``dist`` functions, seen only by a function mode (above). Not found by the scan (strings); listed for
    the reader.

``torch.distributed.tensor.debug._clear_python_sharding_prop_cache``,
``torch._C._clear_DTensor_sharding_propagator_cache``
    where: planning/trace.py:forget_meshes
    why: DTensor's sharding-propagation caches (Python and C++ fast path) key on meshes by value and hand out output
    specs that hold the equal mesh of an earlier trace, whose fake process group is gone; FSDP gathers over the mesh
    its parameters hold, so a sharded trace empties them first.
    public: none; DTensor exposes no cache control (these are its debug helpers).

``torch._ops.HigherOrderOperator``
    where: bench/collectives.py:FunctionalCollectiveCounter.__torch_dispatch__,
    planning/live.py:LiveTensorBytes.__torch_dispatch__
    why: lets higher-order operators pass through a dispatch mode unexamined.
    public: none; the class is not exported publicly.

``OpOverload._schema``
    where: planning/trace.py:_attention_flops, bench/layer_cost.py:_is_view, bench/layer_cost.py:_read_bytes
    why: argument names of an attention op, to price its FLOPs; whether an op's result aliases an input (a view:
    no memory traffic); which of its arguments are ``out=`` buffers (written, not read).
    public: none; the schema is exposed only there.

``UntypedStorage._cdata``
    where: planning/trace.py:_storage
    why: the address of a tensor's StorageImpl tells storages apart while they live, fake ones too.
    public: none. ``data_ptr()`` of a fake storage is 0 (and deprecated); ``id()`` of the Python storage object
    changes from call to call.

``torch.ops._c10d_functional``
    where: bench/collectives.py:(module)
    why: the native functional-collective ops DTensor redistributions issue: the op set the counter recognises.
    public: none; the Python wrappers (``torch.distributed._functional_collectives``) are private too.

``torch.testing._internal.distributed.fake_pg.FakeStore``
    where: planning/trace.py:fake_group, planning/trace.py:_run_here
    why: importing the module registers the ``"fake"`` process-group backend the schedule tracer runs on (no
    peers, no communication).
    public: partly: ``torch.distributed.HashStore`` can replace ``FakeStore``, but only this import registers the
    backend.

``torch._C._is_alias_of``
    where: ops.py:_aliases
    why: whether a registered op's output shares memory with an input or an earlier output (custom ops must return
    fresh memory; such outputs are copied). Works on fake tensors, where storage pointers are not available.
    public: none; ``untyped_storage().data_ptr()`` is 0 on fake tensors.

``Tensor._version``
    where: ops.py:_versions
    why: an in-place write into an input of a registered op that the op does not declare is a bug that would
    silently break compiled graphs; comparing version counters before and after catches it.
    public: none; autograd's own check (``saved tensor ... modified by an inplace operation``) uses the same counter.

``ProcessGroupGloo._Options``, ``Backend.Options._timeout`` (``ProcessGroupNCCL.Options._timeout``)
    where: mesh.py:_timeout_override
    why: ``init_device_mesh`` creates its axis groups with torch's 30-minute default whatever timeout the default
    group got; its ``backend_override`` takes backend options, and the timeout is their ``_timeout`` (torch's own
    DeviceMesh reads it back from there).
    public: none; ``init_device_mesh`` has no timeout argument. Creating the axis groups with
    ``new_group(timeout=...)`` and ``DeviceMesh.from_group`` would avoid it, but a mesh built that way is not the
    root mesh torch slices sub-meshes from (``mesh["row", "col"]``) and FSDP2 concatenates with: kept.

``ProcessGroup._get_backend``, ``Backend.options._timeout``
    where: mesh.py:group_timeout
    why: the timeout a group was created with (the default group's, for the axis groups to inherit; tests check the
    axis groups').
    public: none; torch does not expose a group's timeout.

``DTensor._spec``, ``DTensor._local_tensor``, ``torch.distributed.tensor._utils.compute_global_tensor_info``
    where: nn/functional.py:local_view, nn/functional.py:local_param, nn/functional.py:_LocalView,
    nn/functional.py:_as_param_grad, nn/functional.py:_to_param_grad, nn/functional.py:own_leaf_grads
    why: the layers' one crossing from a DTensor parameter to its local shard. ``local_view`` hands out
    ``_local_tensor`` itself, armed as an autograd leaf of its own (below): no op and no autograd node per use, so
    one rank dispatches the plain model's ops; the shard's hook (``_to_param_grad``) checks that it is still its
    parameter's ``_local_tensor`` before moving its gradient there. Where a shard cannot be a leaf (FSDP's gathered parameters),
    ``_LocalView`` makes a view of ``_local_tensor`` forward, and backward wraps the gradient as a DTensor with (a
    copy of) the parameter's own ``_spec`` when its global stride (``compute_global_tensor_info``) matches.
    ``DTensor.to_local()`` does the same forward, but its backward builds the gradient through
    ``DTensor.from_local`` (a second autograd function and a checked new spec): a second view op and ~120 us per
    parameter and step on CPU.
    public: ``DTensor.to_local()``, which ``local_view`` uses under ``torch.compile`` (traced into the graph).
    ``DTensor._spec`` is read once per parameter (nn/functional.py:_grad_spec): the gradients' spec is a copy of it
    made once and shared by every step's gradient (a copy per gradient cost 31 us per parameter and step). The
    gradient's wrapper is made by ``DTensor.__new__(DTensor, local, spec, requires_grad=False)`` alone
    (nn/functional.py:_as_param_grad): ``DTensor(...)`` (itself documented as not public) adds an ``__init__`` that
    does nothing but switch Dynamo off and on, 2.8 of its 4.5 us. Under ``torch.compile`` the armed shard is found
    through the module's links (nn/functional.py:local_param), not through the DTensor, which Dynamo would guard by
    its whole spec in Python on every call.

``DTensor._local_tensor`` (bench)
    where: bench/layer_cost.py:_bytes
    why: the memory-bound bytes a rank moves when torch's DTensor code runs an op: a dispatch mode sees the DTensor op
    with its global shapes (DTensor then runs it on the shards outside the mode), so each DTensor argument and result
    counts its shard's bytes. Read inside a dispatch mode, where ``to_local()`` (an autograd function) would add work.
    public: ``DTensor.to_local()``.

``Module._parameters``
    where: nn/functional.py:_holder, nn/functional.py:_to_param_grad, nn/functional.py:local_param
    why: the parameter a module holds under a name: that an armed shard's parameter is still the one its hook will
    find there, read on every use and every backward. ``getattr(module, name)`` reaches it through
    ``Module.__getattr__`` after a failed attribute lookup: 5 us a call on CPU, 0.3 ms of a 3 ms gpt2-tiny step.
    public: ``getattr(module, name)`` or ``Module.get_parameter(name)`` (the same dictionary, slower).

``Tensor._post_accumulate_grad_hooks``
    where: nn/functional.py:_to_param_grad
    why: an armed shard's gradient accumulates on the shard (a plain tensor: no DTensor dispatch per accumulation)
    and its hook moves it into ``param.grad``; autograd never accumulates into the parameter itself, so the hook
    then runs the hooks registered on the parameter (the data-parallel gradient buckets', FSDP's averaging of the
    parameters it keeps whole, a user's) as autograd would have.
    public: none; ``register_post_accumulate_grad_hook`` registers hooks but nothing lists or runs them.

``DTensor._op_dispatcher._custom_op_handlers``, ``torch.ops.aten._fused_adamw_``, ``torch.ops.aten._fused_adam_``,
``DTensor._spec``, ``DTensor._local_tensor``
    where: fused_adam.py:_handlers, fused_adam.py:_aligned, fused_adam.py:_like, fused_adam.py:(module)
    why: the fused AdamW step (``CausalLMModule``'s optimizer) over DTensor parameters runs DTensor's sharding
    propagation over four lists of DTensors each step: 15.8 ms for 300 parameters on CPU against 4.1 ms on plain
    tensors. A handler for the fused ops calls the kernel on the local shards when every gradient and moment is laid
    out as its parameter (an elementwise kernel needs nothing else) and leaves every other call to DTensor's own
    dispatch; 6.2 ms.
    public: none. DTensor has no public hook for an op's dispatch; torch's own ``loss_parallel`` uses this table.

``torch.distributed._functional_collectives`` (``all_reduce``, ``wait_tensor``)
    where: nn/traced.py:(module), nn/traced.py:_AllReduceSum.forward, nn/traced.py:_AllReduceSum.backward,
    nn/traced.py:_AllReduceToReplica.forward, nn/traced.py:_SumGradient.backward,
    nn/traced.py:_SumGradients.backward, nn/traced.py:all_reduce_max
    why: under ``torch.compile`` the norms' statistics, the vocab-parallel loss and the summed parameter gradients
    are plain torch around functional all-reduces, which Dynamo traces (c10d's in-place calls it cannot), so the
    compiler fuses the local math instead of treating each layer as an opaque op.
    public: none for traceable collectives; torch's own DTensor and torchtitan use this module.

``DeviceMesh._pg_registry``
    where: mesh.py:release_process_groups
    why: at exit, the meshes init_mesh built drop their references to their process groups (torch 2.13 keeps them
    in this dict), so the groups' destructors join their gloo worker threads while the interpreter is whole. A
    worker left to interpreter shutdown aborts the process (SIGABRT, "terminate called without an active
    exception") when it frees a finished work's tensor; ``destroy_process_group`` alone does not free a group a mesh
    still holds. Absent in older torch (meshes there hold names only), where nothing needs dropping.
    public: none; ``destroy_process_group`` unregisters groups but cannot free what a DeviceMesh holds.

``DeviceMesh._dim_group_names``
    where: ops.py:_mesh_names, ops.py:register_mesh
    why: names a mesh by its process groups inside traced code: torch.compile reads it on the real mesh at trace
    time (a ``USE_REAL`` member of the opaque mesh type), so the registered ops' constants hold a name, not the
    mesh object (which would become a graph input that activation checkpointing's recompute cannot save). Under
    torch 2.11 (no opaque mesh type) it is read once, eagerly, in register_mesh and kept on the mesh.
    public: none; ``mesh.get_group(axis).group_name`` is the same name but is traced through the process group.

``torch._library.opaque_object.is_opaque_type``
    where: ops.py:_is_opaque
    why: whether Dynamo treats ``DeviceMesh`` as an opaque reference type (torch 2.13 registers it when a mesh is
    built; torch 2.11 does not), which decides how traced code may read a mesh's names (above).
    public: none.

``torch._assert_async``
    where: models/gpt2.py:GPT2._assert_ids_on_device (Llama shares it)
    why: under ``torch.compile`` the token-id checks of ``validate_inputs`` must not read values on the host (each
    read was a graph break: 4 graphs on "2d"); a device-side assert stays in the one graph and raises with its
    message when an id is out of range.
    public: ``torch._check`` needs a host value too; none for a tensor-valued assert.

``Tensor._base``
    where: recompute.py:recipe_for, recompute.py:mark
    why: a consumer often saves a view of a marked tensor (``x.reshape(-1, h)`` before a SUMMA product); its base
    tells which recipe rebuilds it, and the view's geometry is replayed on the rebuilt base.
    public: none; ``Tensor.is_view()`` says whether, not of what.

``FakeScriptObject.real_obj`` (read with ``object.__getattribute__``)
    where: ops.py:_real
    why: under ``torch.compile`` a ``DeviceMesh`` (a reference-type opaque object since torch 2.10) reaches
    ``assume_constant_result`` functions as a ``FakeScriptObject``; the table of op constants keeps the real mesh.
    public: none. Not found by the scan (the attribute name has no underscore); listed for the reader.

DeepSpeed (0.19.8, the optional ``bench`` extra; the Ulysses rival only)
-----------------------------------------------------------------------

``parallel_state_sp._release_sequence_parallel_groups``
    where: baselines/ulysses.py:ulysses_attention
    why: ``UlyssesSPAttentionHF.register_with_transformers`` builds DeepSpeed's sequence-parallel groups in a
    module-level registry; releasing them when a scenario ends lets the next one (another ``p``, the same ranks)
    register again instead of failing on groups that already exist.
    public: none; DeepSpeed has no unregister.
"""

from __future__ import annotations

# (api, used_in, why): api names the owner and the private name (several names: comma-separated; an instance patch:
# ``Owner.method = ...``); used_in is ``file:function`` relative to lightning_tp2d/ (``(module)`` for module level).
PRIVATE_APIS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    # ---- Lightning ----
    ("ModelParallelStrategy._configure_launcher", ("strategy.py:TP2DStrategy._configure_launcher",),
     "check precision and (p, dp) once devices, nodes and precision are known, before any process is launched"),
    ("ModelParallelStrategy._setup_distributed", ("strategy.py:TP2DStrategy.setup_environment",),
     "initialise the process group Lightning's way without building Lightning's own mesh"),
    ("ModelParallelStrategy._launcher", ("strategy.py:TP2DStrategy._configure_launcher",),
     "check the data against the model in the launching process, before Lightning starts the other ranks"),
    ("LightningModule._device_mesh", ("strategy.py:TP2DStrategy.setup_environment",),
     "LightningModule.device_mesh is a read-only property; the strategy hands the mesh over as Lightning does"),
    ("LightningModule._trainer",
     ("module.py:CausalLMModule.configure_model", "module.py:CausalLMModule.setup",
      "module.py:CausalLMModule.configure_optimizers"),
     "whether the module is attached to a Trainer (the trainer property raises when it is not)"),
    ("ModelCheckpoint._should_skip_saving_checkpoint, ModelCheckpoint._monitor_candidates, "
     "ModelCheckpoint._save_topk_checkpoint, ModelCheckpoint._save_last_checkpoint",
     ("callbacks.py:StepCheckpoint.save_now",),
     "save the final step with Lightning's own skip rule, candidates and top-k / last bookkeeping"),
    ("RichProgressBar._get_train_description", ("callbacks.py:ResumableRichProgressBar._get_train_description",),
     "Lightning's bar writes Epoch 0/-2 without an epoch limit"),
    ("_TrainingEpochLoop._broadcast_sigterm_tensor = ...", ("callbacks.py:GracefulInterrupt.on_train_start",),
     "Lightning's per-batch broadcast and .item() of a SIGTERM flag that GracefulInterrupt's handlers never set"),
    ("Precision.clip_grad_by_norm = ..., Precision.clip_grad_by_value = ...",
     ("strategy.py:TP2DStrategy._install_gradient_clipping",),
     "Trainer(gradient_clip_val=...) clips through the precision plugin; the norm must span every shard"),
    # ---- Lightning Fabric ----
    ("lightning.fabric.strategies.ModelParallelStrategy._configure_launcher",
     ("fabric.py:TP2DFabricStrategy._configure_launcher",),
     "check precision and (p, dp) in the launching process, before any process starts"),
    ("lightning.fabric.strategies.ModelParallelStrategy._setup_distributed",
     ("fabric.py:TP2DFabricStrategy.setup_environment",),
     "initialise the process group Lightning's way without building Lightning's own mesh"),
    ("lightning.fabric.strategies.strategy._BackwardSyncControl, Strategy._backward_sync_control",
     ("fabric.py:_GradientSyncControl", "fabric.py:TP2DFabricStrategy._init_state"),
     "fabric.no_backward_sync asks the strategy's _backward_sync_control for the context that skips the sync"),
    # ---- torch ----
    ("torch.distributed.tensor.placement_types._StridedShard",
     ("nn/linear.py:_out_shard", "nn/ring.py:RingLinear.__init__", "checkpoint.py:box_view",
      "checkpoint.py:_strided_over_dp_only", "fsdp.py:_dp_shard_dim", "fsdp.py:_stage0_only"),
     "the only DTensor placement for the fused c_attn rows [q_i; k_i; v_i] of one rank"),
    ("torch.ops.aten._scaled_dot_product_flash_attention_for_cpu",
     ("metp.py:block_kernel", "metp.py:_fused_forward", "baselines/context_parallel.py:(module)"),
     "the CPU flash kernel returns the log-sum-exp the ring's online-softmax merge needs"),
    ("torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward",
     ("metp.py:_fused_backward", "baselines/context_parallel.py:(module)"),
     "the block backward from the global output and log-sum-exp"),
    ("torch._scaled_mm", ("float8.py:TensorwiseGemm._scaled", "planning/trace.py:(module)"),
     "the float8 GEMM with per-operand scales (no public float8 GEMM in torch)"),
    ("torch.ops.aten._scaled_dot_product_flash_attention, torch.ops.aten._scaled_dot_product_efficient_attention, "
     "torch.ops.aten._scaled_dot_product_cudnn_attention",
     ("metp.py:_fused_forward",), "CUDA fused attention returning the log-sum-exp the ring merge needs"),
    ("torch.ops.aten._scaled_dot_product_flash_attention_backward, "
     "torch.ops.aten._scaled_dot_product_efficient_attention_backward, "
     "torch.ops.aten._scaled_dot_product_cudnn_attention_backward",
     ("metp.py:_fused_backward",), "their block backward from the global output and log-sum-exp"),
    ("DTensor._op_dispatcher._custom_op_handlers, torch.ops.aten._log_softmax",
     ("baselines/tp1d.py:_loss_parallel_active",),
     "whether torch's loss_parallel() handlers are installed right now"),
    ("torch.distributed.tensor.experimental._context_parallel._attention._templated_ring_attention, "
     "_templated_ring_attention_backward",
     ("baselines/context_parallel.py:_ring_forward", "baselines/context_parallel.py:_ring_backward",
      "baselines/context_parallel.py:cpu_ring_attention"),
     "torch's own CP ring attention, run with the CPU flash kernel; its handler table takes the CPU op's handler"),
    ("torch.distributed.tensor.experimental._context_parallel._sharding_rules._op_strategy_context, "
     "torch.distributed.tensor._ops.utils.expand_to_full_mesh_op_strategy",
     ("baselines/context_parallel.py:cpu_ring_attention", "baselines/context_parallel.py:_forward_strategy",
      "baselines/context_parallel.py:_backward_strategy"),
     "register the CPU flash op's sequence-sharded strategy for a block, as torch's CP does for the CUDA ops"),
    ("DTensor._op_dispatcher", ("baselines/context_parallel.py:_cpu_sdpa_handler",),
     "unwrap, propagate and wrap around the ring, as torch's _sdpa_handler"),
    ("torch._subclasses.fake_tensor.FakeTensor, torch._subclasses.fake_tensor.FakeTensorMode",
     ("bench/collectives.py:_shape_only", "planning/live.py:_storage_key", "planning/live.py:LiveTensorBytes",
      "planning/memory_model.py:_shards_here", "planning/trace.py:_run_here"),
     "recognise DTensor's shape-propagation tensors; trace the parallel model without memory or compute"),
    ("torch.utils._python_dispatch.TorchDispatchMode",
     ("bench/collectives.py:FunctionalCollectiveCounter", "planning/live.py:LiveTensorBytes",
      "bench/measure.py:HostSyncCounter", "planning/trace.py:_Recorder", "comm_record.py:_direct_collectives",
      "bench/layer_cost.py:OpCounter"),
     "see every aten op: collectives with their bytes, live tensor bytes, host syncs, the traced schedule, FSDP's c10d "
     "collectives"),
    ("torch.distributed.tensor.debug._clear_python_sharding_prop_cache, "
     "torch._C._clear_DTensor_sharding_propagator_cache", ("planning/trace.py:forget_meshes",),
     "DTensor's caches hand stale (equal) meshes of earlier traces to new parameters, which FSDP gathers over"),
    ("torch._ops.HigherOrderOperator",
     ("bench/collectives.py:FunctionalCollectiveCounter.__torch_dispatch__",
      "planning/live.py:LiveTensorBytes.__torch_dispatch__"),
     "let higher-order operators pass through a dispatch mode unexamined"),
    ("OpOverload._schema", ("planning/trace.py:_attention_flops", "bench/layer_cost.py:_is_view",
                            "bench/layer_cost.py:_read_bytes"),
     "argument names of an attention op, to price its FLOPs; whether an op is a view; its out= arguments"),
    ("DTensor._spec, DTensor._local_tensor, torch.distributed.tensor._utils.compute_global_tensor_info",
     ("nn/functional.py:local_view", "nn/functional.py:local_param", "nn/functional.py:_LocalView",
      "nn/functional.py:_as_param_grad", "nn/functional.py:_to_param_grad", "nn/functional.py:own_leaf_grads"),
     "the layers' one crossing to a parameter's local shard: the shard itself as a leaf, else a view whose backward "
     "skips to_local's from_local"),
    ("DTensor._local_tensor", ("bench/layer_cost.py:_bytes",),
     "the bytes of a DTensor op's shards, counted by a dispatch mode that sees the global shapes"),
    ("Module._parameters", ("nn/functional.py:_holder", "nn/functional.py:_to_param_grad",
                            "nn/functional.py:local_param"),
     "the parameter a module holds under a name, without Module.__getattr__ (5 us a call)"),
    ("Tensor._post_accumulate_grad_hooks", ("nn/functional.py:_to_param_grad",),
     "run the parameter's own post-accumulate hooks once its armed shard's gradient is moved into param.grad"),
    ("DTensor._spec", ("nn/functional.py:_grad_spec",), "one gradient spec per parameter, copied once"),
    ("DTensor._op_dispatcher._custom_op_handlers, torch.ops.aten._fused_adamw_, torch.ops.aten._fused_adam_, "
     "DTensor._spec, DTensor._local_tensor",
     ("fused_adam.py:_handlers", "fused_adam.py:_aligned", "fused_adam.py:_like", "fused_adam.py:(module)"),
     "the fused AdamW step on the local shards when every tensor is laid out as its parameter"),
    ("torch.distributed._functional_collectives",
     ("nn/traced.py:(module)", "nn/traced.py:_AllReduceSum.forward", "nn/traced.py:_AllReduceSum.backward",
      "nn/traced.py:_AllReduceToReplica.forward", "nn/traced.py:_SumGradient.backward",
      "nn/traced.py:_SumGradients.backward", "nn/traced.py:all_reduce_max"),
     "all-reduces Dynamo traces: the compiled layers' local math stays visible to the compiler"),
    ("UntypedStorage._cdata", ("planning/trace.py:_storage",),
     "the StorageImpl's address: a key that tells storages apart while they live, fake ones too"),
    ("torch.ops._c10d_functional", ("bench/collectives.py:(module)",),
     "the native functional-collective ops DTensor redistributions issue"),
    ("torch._C._is_alias_of", ("ops.py:_aliases",), "custom ops must return fresh memory: copy outputs that alias"),
    ("Tensor._version", ("ops.py:_versions",), "catch an undeclared in-place write into a registered op's input"),
    ("torch._assert_async", ("models/gpt2.py:GPT2._assert_ids_on_device",),
     "token-id checks that compile into the graph (no host read, no graph break)"),
    ("Tensor._base", ("recompute.py:recipe_for", "recompute.py:mark"), "the marked tensor a saved view was taken of"),
    ("ProcessGroupGloo._Options, Backend.Options._timeout", ("mesh.py:_timeout_override",),
     "give init_device_mesh's axis groups the job's timeout (its backend_override takes options)"),
    ("ProcessGroup._get_backend, Backend.options._timeout", ("mesh.py:group_timeout",),
     "the timeout a process group was created with"),
    ("DeviceMesh._pg_registry", ("mesh.py:release_process_groups",),
     "drop a mesh's process groups at exit, so their gloo threads are joined before interpreter shutdown"),
    ("DeviceMesh._dim_group_names", ("ops.py:_mesh_names", "ops.py:register_mesh"),
     "a mesh's name, read at trace time, for op constants"),
    ("torch._library.opaque_object.is_opaque_type", ("ops.py:_is_opaque",),
     "whether Dynamo treats DeviceMesh as an opaque type (torch 2.13) or not (2.11)"),
    ("torch.testing._internal.distributed.fake_pg.FakeStore", ("planning/trace.py:fake_group",
                                                               "planning/trace.py:_run_here"),
     "importing it registers the 'fake' process-group backend the schedule tracer runs on"),
    # ---- DeepSpeed (bench only) ----
    ("parallel_state_sp._release_sequence_parallel_groups", ("baselines/ulysses.py:ulysses_attention",),
     "free DeepSpeed's sequence-parallel groups when a Ulysses scenario ends, so the next can register"),
)
