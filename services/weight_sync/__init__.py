"""Weight sync: moving the actor's weights to the rollout replicas (and the reference).

gRPC carries the control messages; the bytes move over a collective:

1. The actor opens a group (ActorService.OpenWeightSyncGroup) and is its rank 0. It returns the
   rendezvous info: a TCP store address (gloo), an NCCL unique id (nccl), or nothing (grpc).
2. Each receiver joins with its rank (JoinWeightSyncGroup); the group survives across steps.
3. Per sync the actor gathers its full weights, casts them to the receivers' dtype and packs them
   into flat buckets (~weight_sync.bucket_mb each, CRC-32 per bucket), and returns the manifest
   (PrepareWeightSync). Then BroadcastWeights on the actor and ReceiveWeights on every receiver run
   together; over grpc the actor streams the buckets itself (PushWeights, several streams per
   receiver, see grpc_stream).
4. A receiver checks the manifest against its own weights (WeightLimits: names, shapes, total
   bytes) before it allocates anything, checks every bucket as it lands and switches its served
   weights to the new version in one step between requests; a checksum mismatch rejects the whole
   update (INVALID_ARGUMENT) and the old version keeps serving.

With actor.lora and weight_sync.lora resolved to adapter (RunConfig.syncs_lora_adapters), step 3
packs the LoRA adapters alone (peft names) and the manifest carries their settings (lora_adapter:
rank, alpha, target modules); receivers check every lora_A / lora_B against the targeted layer of
their own base model (WeightLimits.check_adapter) and apply it on that base model (the hf engine
through peft, vLLM through its LoRA API), so a sync moves rank x (in + out) numbers per adapted layer
instead of the whole model. Every transport carries either kind of manifest alike.

With rollout.engine sglang the actor opens its gloo and nccl groups as torch groups (torch_group): a
torch.distributed process group built as SGLang builds its weight-update group, which an SGLang server
joins with /init_weights_update_group, and dense buckets (SGLang's flattened layout), which it receives
with /update_weights_from_distributed (rlfabric.rollout.sglang_engine).

With weight_sync.delta (gloo, nccl and grpc groups, full weights), the actor keeps what it last sent in the
receivers' dtype, and every receiver keeps what it received (WeightManifest.keep_base). When every receiver holds
the version last sent, step 3 packs each tensor's change against it instead (WeightManifest.delta: per tensor an
encoding and the CRC-32 of the result, rlfabric.weight_sync.delta); a receiver rebuilds the full weights from its
base, checks every tensor, and switches to them as after a full sync. A receiver that cannot (another base, a
tensor that does not check out) rejects the delta and gets the full weights.

With weight_sync.relay chain (grpc), step 3 pushes to the first replica alone, which forwards each chunk to the
next as it lands, and so on (chain): the actor sends one copy whatever the number of replicas. Every replica
checks the actor's CRC-32s as after a direct push; one that fails is routed around. A delta relayed down a chain
is the one every replica holds the base of (the plane sends deltas only then), else the full weights go to all.

Modules (the package exports nothing: import a name from the module that defines it; importing the package
loads no torch, so what needs only devices or phases, such as the launcher's placement, does not either):

    manifest     Manifest, SyncGroup, BucketSpec, TensorSpec, AdapterSpec, WeightLimits; proto conversion
    buckets      plan_buckets, pack, unpack, ChecksumMismatch, CRC-32
    receiver     WeightReceiver, BucketAssembler, Membership, WeightSwap (receiving side)
    sender       WeightSender (actor side); pipeline: bucket k+1 packed while bucket k is on the wire
    delta        delta sync: DeltaSender (the actor's base), DeltaBase (a receiver's), the encodings
    gloo, nccl, torch_group, cuda_ipc    the collective transports; grpc_stream: PushWeights, both ends
    chunks       the wire format of a PushWeights chunk
    chain        between replicas (weight_sync.relay chain, grpc): each forwards the push to the next
    relay        into a tensor-parallel replica: its TP rank 0 forwards each bucket to its peers
    devices      what each service reports of its devices, and the transport chosen from it
    phases       how long each phase of a sync took (SyncPhases, PhaseClock)

The coordinator drives all of it through rlfabric.coordinator.weight_sync.WeightSyncPlane.
"""
