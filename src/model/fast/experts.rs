//! The routed experts of the fast path: MXFP4 gate_up, the clamped SwiGLU, MXFP4 down, each
//! expert's output weighted into its tokens' mixture.

use super::jobs::{quantize_in_task, run_whole_job, Job, SharedOut, SharedSlots};
use super::{FastPass, Scratch, PREFILL_CHUNK};
use crate::kernels::swiglu::swiglu;
use crate::kernels::Q8Activations;
use crate::model::ops::{add_bias_rows, add_weighted, MAX_EXPERTS_PER_TOKEN};
use crate::model::options::{Product, Split};
use crate::model::profile::Phase;
use crate::model::team::parallel_for;
use crate::model::weights::Layer;

/// Most experts whose products share one parallel region (a group): each has its own input and
/// activation buffers in [`Scratch`].
pub(super) const GROUP_SLOTS: usize = 32;

/// Fewest experts in a group, per thread of the team, for each expert to run whole on one
/// thread ([`FastPass::run_group_fused`]); fewer are split by rows across the team.
const FUSED_SLOTS_PER_THREAD: usize = 4;

/// Most tokens routed to an expert for it to join a group. An expert with more runs alone: its
/// products are long enough that their own regions cost little, and a slot's buffers stay small
/// (32 slots of 2 x 64 int8 rows: 12 MB on the 20b). At 64 about half of a 512-token chunk's
/// experts (64 tokens each on average) join groups of about 8, which run whole per thread:
/// pp512 +3.6% against 32 in five alternations on Zen 4, 2 threads (medians 66.5 / 64.2).
pub(super) const GROUPED_TOKENS: usize = 64;

/// How many quantized rows a token has in each expert product, by the session's activations.
struct ExpertRows {
    per_gate_up: usize,
    /// How the down input (the SwiGLU output) is quantized.
    down_split: Split,
    per_down: usize,
}

impl FastPass<'_> {
    fn expert_rows(&self) -> ExpertRows {
        let down_split = self.activations.split(Product::ExpertDown);
        ExpertRows {
            per_gate_up: self
                .activations
                .split(Product::ExpertGateUp)
                .rows_per_token(),
            down_split,
            per_down: down_split.rows_per_token(),
        }
    }

    /// Several tokens (a batch of decoded sequences, a prefill chunk): the experts in index
    /// order, those with few tokens in groups ([`Self::run_group`]), the others alone. One region
    /// pair per expert would cost a batched decode step ~1,700 region barriers, more than the
    /// products themselves at a few tokens per expert.
    /// Each token's expert outputs are added in expert order, as [`Self::decode_experts`] does.
    pub(super) fn batch_experts(&self, layer: &Layer, s: &mut Scratch) {
        // The group's tokens fit the chunk-sized product buffers.
        let capacity = PREFILL_CHUNK.max(self.config.num_experts_per_tok);
        s.group.clear();
        let mut tokens = 0;
        for expert in 0..s.routes.len() {
            let m = s.routes[expert].len();
            if m == 0 {
                continue;
            }
            if m > GROUPED_TOKENS {
                // The pending group first, to keep the expert order of each token's sum.
                self.run_group(layer, s);
                tokens = 0;
                self.prefill_expert(layer, expert, s);
                continue;
            }
            if tokens + m > capacity || s.group.len() == GROUP_SLOTS {
                self.run_group(layer, s);
                tokens = 0;
            }
            s.group.push(expert);
            tokens += m;
        }
        self.run_group(layer, s);
    }

    /// The experts in `s.group`, each over its routed tokens: whole per thread where there are
    /// enough of them ([`Self::run_group_fused`]), else each product split by rows across the
    /// team ([`Self::run_group_split`]); empties the group.
    fn run_group(&self, layer: &Layer, s: &mut Scratch) {
        let count = s.group.len();
        if count == 0 {
            return;
        }
        let h = self.config.hidden_size;
        let rows = self.expert_rows();
        let per_gate_up = rows.per_gate_up;

        // Slot k's tokens start at token `first[k]` of the group.
        let mut first = [0usize; GROUP_SLOTS + 1];
        for (slot, &expert) in s.group.iter().enumerate() {
            first[slot + 1] = first[slot] + s.routes[expert].len();
            s.route_rows.clear();
            for &(i, _) in &s.routes[expert] {
                s.route_rows.extend(per_gate_up * i..per_gate_up * (i + 1));
            }
            s.group_in[slot]
                .gather_rows(&s.expert_in_q, &s.route_rows)
                .expect("routed rows are chunk rows");
        }
        // A team exists only with more than one thread, all of them in this pool.
        let threads = match self.team {
            Some(_) => rayon::current_num_threads(),
            None => 1,
        };
        if threads > 1 && count >= FUSED_SLOTS_PER_THREAD * threads {
            self.run_group_fused(layer, s, &first, &rows);
        } else {
            self.run_group_split(layer, s, &first, &rows);
        }

        // Each token's outputs are added in expert order (the slots' order).
        for (slot, &expert) in s.group.iter().enumerate() {
            let (start, m) = (first[slot], first[slot + 1] - first[slot]);
            let block = &mut s.expert_out[start * h..(start + m) * h];
            for (y, &(i, weight)) in block.chunks_exact_mut(h).zip(&s.routes[expert]) {
                add_bias_rows(y, layer.down.bias(expert));
                add_weighted(&mut s.moe_out[i * h..(i + 1) * h], weight, y);
            }
        }
        s.group.clear();
    }

    /// Each expert of the group whole on one thread, as one task: gate_up, bias, SwiGLU,
    /// quantization and down, largest first. No barrier between an expert's two products, and
    /// while one thread streams an expert's gate_up (about 7 tokens each in a 58-token prompt:
    /// bound by reading its weights) the other can be in a down product (twice the rows with
    /// split activations: bound by arithmetic), where three regions (all gate_up, the SwiGLUs,
    /// all down) had both threads in the same kind of work and waiting at each end. Same kernel
    /// calls as [`Self::run_group_split`] for a group this large (its tasks are whole experts
    /// too), so the same bits.
    fn run_group_fused(
        &self,
        layer: &Layer,
        s: &mut Scratch,
        first: &[usize; GROUP_SLOTS + 1],
        rows: &ExpertRows,
    ) {
        let c = self.config;
        let (h, inter) = (c.hidden_size, c.intermediate_size);
        let &ExpertRows {
            per_gate_up,
            down_split,
            per_down,
        } = rows;
        let count = s.group.len();
        let total = first[count];
        let mut order: [usize; GROUP_SLOTS] = std::array::from_fn(|slot| slot);
        let order = &mut order[..count];
        order
            .sort_unstable_by_key(|&slot| (std::cmp::Reverse(first[slot + 1] - first[slot]), slot));

        // A slot's part rows of either product go through its own range of the blocked scratch.
        let block_stride = (per_gate_up * 2 * inter).max(per_down * h);
        let blocked = s.work.shared_blocked(total * block_stride);
        assert!(total * 2 * inter <= s.gate_up.len() && total * inter <= s.activated.len());
        assert!(total * h <= s.expert_out.len() && count <= s.activated_q.len());
        let gate_up = SharedOut(s.gate_up.as_mut_ptr());
        let activated = SharedOut(s.activated.as_mut_ptr());
        let activated_q = SharedSlots(s.activated_q.as_mut_ptr());
        let expert_out = SharedOut(s.expert_out.as_mut_ptr());
        let (group, group_in, kernels) = (&s.group, &s.group_in, self.kernels);
        let order = &*order;
        let task = |place: usize| {
            let slot = order[place];
            let (start, m) = (first[slot], first[slot + 1] - first[slot]);
            let expert = group[slot];
            // SAFETY: slot `slot` owns tokens `start..start + m` of the group: those rows of
            // `gate_up`, `activated` and `expert_out`, its range of the blocked scratch and its
            // own `activated_q` (sizes checked above); each slot is one task.
            let (block, up, act, q, out) = unsafe {
                (
                    blocked.slice(start * block_stride, m * block_stride),
                    gate_up.slice(start * 2 * inter, m * 2 * inter),
                    activated.slice(start * inter, m * inter),
                    activated_q.get(slot),
                    expert_out.slice(start * h, m * h),
                )
            };
            let job = Job::expert(&layer.gate_up, expert, &group_in[slot], per_gate_up * m, 0)
                .folded(per_gate_up);
            run_whole_job(kernels, &job, &mut block[..per_gate_up * m * 2 * inter], up);
            self.activate(layer, expert, down_split, up, act, q);
            let job = Job::expert(&layer.down, expert, q, per_down * m, 0).folded(per_down);
            run_whole_job(kernels, &job, &mut block[..per_down * m * h], out);
        };
        parallel_for(self.team, count, &task);
    }

    /// One slot's step between its products, on the calling thread (a task): `gate_up` (the
    /// slot's rows of 2 x inter interleaved pairs, so its tokens are one run of pairs) gets the
    /// expert's bias, the clamped SwiGLU goes to `activated`, and that is quantized into `q` as
    /// the down product takes it.
    fn activate(
        &self,
        layer: &Layer,
        expert: usize,
        down_split: Split,
        gate_up: &mut [f32],
        activated: &mut [f32],
        q: &mut Q8Activations,
    ) {
        self.biased_swiglu(layer, expert, gate_up, activated);
        let inter = self.config.intermediate_size;
        quantize_in_task(self.kernels, activated, inter, down_split, q);
    }

    /// `gate_up` (rows of 2 x inter interleaved pairs) gets the expert's bias, and the clamped
    /// SwiGLU of it goes to `activated`: what every path does between an expert's products
    /// before quantizing the down input its own way.
    fn biased_swiglu(
        &self,
        layer: &Layer,
        expert: usize,
        gate_up: &mut [f32],
        activated: &mut [f32],
    ) {
        let c = self.config;
        add_bias_rows(gate_up, layer.gate_up.bias(expert));
        swiglu(
            self.kernels,
            gate_up,
            c.swiglu_limit,
            c.swiglu_alpha,
            activated,
        );
    }

    /// The group's gate_up products in one region (split by rows where experts are few), the
    /// SwiGLUs in another, the down products in a third.
    fn run_group_split(
        &self,
        layer: &Layer,
        s: &mut Scratch,
        first: &[usize; GROUP_SLOTS + 1],
        rows: &ExpertRows,
    ) {
        let c = self.config;
        let (h, inter) = (c.hidden_size, c.intermediate_size);
        let &ExpertRows {
            per_gate_up,
            down_split,
            per_down,
        } = rows;
        let count = s.group.len();
        let total = first[count];

        // Fixed arrays of jobs (slots past `count` repeat the first and are never run).
        let group = &s.group;
        let group_in = &s.group_in;
        let jobs: [Job<'_>; GROUP_SLOTS] = std::array::from_fn(|slot| {
            let slot = if slot < count { slot } else { 0 };
            let m = first[slot + 1] - first[slot];
            let at = first[slot] * 2 * inter;
            Job::expert(
                &layer.gate_up,
                group[slot],
                &group_in[slot],
                per_gate_up * m,
                at,
            )
            .folded(per_gate_up)
        });
        let gate_up = &mut s.gate_up[..total * 2 * inter];
        s.work.run(self.kernels, self.team, &jobs[..count], gate_up);
        // Each slot's bias, SwiGLU and quantization touch only its own rows, so the slots
        // run as the tasks of one region: on the leader alone they kept the other threads
        // waiting between every group's two products.
        {
            let gate_up = SharedOut(s.gate_up.as_mut_ptr());
            let activated = SharedOut(s.activated.as_mut_ptr());
            let activated_q = SharedSlots(s.activated_q.as_mut_ptr());
            let group = &s.group;
            assert!(total * 2 * inter <= s.gate_up.len());
            assert!(total * inter <= s.activated.len() && count <= s.activated_q.len());
            let post = |slot: usize| {
                let (start, m) = (first[slot], first[slot + 1] - first[slot]);
                // SAFETY: slot `slot` owns tokens `start..start + m` of the group: those rows of
                // `gate_up` and `activated` and its own `activated_q` (sizes checked above).
                let (block, activated, out) = unsafe {
                    (
                        gate_up.slice(start * 2 * inter, m * 2 * inter),
                        activated.slice(start * inter, m * inter),
                        activated_q.get(slot),
                    )
                };
                self.activate(layer, group[slot], down_split, block, activated, out);
            };
            parallel_for(self.team, count, &post);
        }

        let activated_q = &s.activated_q;
        let jobs: [Job<'_>; GROUP_SLOTS] = std::array::from_fn(|slot| {
            let slot = if slot < count { slot } else { 0 };
            let m = first[slot + 1] - first[slot];
            let at = first[slot] * h;
            Job::expert(
                &layer.down,
                group[slot],
                &activated_q[slot],
                per_down * m,
                at,
            )
            .folded(per_down)
        });
        let expert_out = &mut s.expert_out[..total * h];
        s.work
            .run(self.kernels, self.team, &jobs[..count], expert_out);
    }

    /// One token: the gate_up products of all its experts in one region, then all down products.
    pub(super) fn decode_experts(&self, layer: &Layer, s: &mut Scratch) {
        let c = self.config;
        let (h, inter) = (c.hidden_size, c.intermediate_size);
        let mut chosen = [(0usize, 0.0f32); MAX_EXPERTS_PER_TOKEN];
        let mut count = 0;
        for (expert, routes) in s.routes.iter().enumerate() {
            if let Some(&(_, weight)) = routes.first() {
                chosen[count] = (expert, weight);
                count += 1;
            }
        }
        let chosen = &chosen[..count];
        let ExpertRows {
            per_gate_up,
            down_split,
            per_down,
        } = self.expert_rows();

        // Fixed arrays of jobs (slots past `count` repeat the first expert and are never run):
        // no allocation per token.
        let expert_in = &s.expert_in_q;
        let jobs: [Job<'_>; MAX_EXPERTS_PER_TOKEN] = std::array::from_fn(|slot| {
            let (expert, _) = chosen[if slot < count { slot } else { 0 }];
            let at = slot * 2 * inter;
            Job::expert(&layer.gate_up, expert, expert_in, per_gate_up, at).folded(per_gate_up)
        });
        let gate_up = &mut s.gate_up[..count * 2 * inter];
        s.work.run(self.kernels, self.team, &jobs[..count], gate_up);
        for (slot, &(expert, _)) in chosen.iter().enumerate() {
            let gate_up = &mut s.gate_up[slot * 2 * inter..(slot + 1) * 2 * inter];
            let activated = &mut s.activated[slot * inter..(slot + 1) * inter];
            self.biased_swiglu(layer, expert, gate_up, activated);
            let outer = s.profile.enter(Phase::Quantization);
            s.work.quantize(
                self.kernels,
                activated,
                inter,
                down_split,
                &mut s.activated_q[slot],
            );
            s.profile.enter(outer);
        }

        let activated_q = &s.activated_q;
        let jobs: [Job<'_>; MAX_EXPERTS_PER_TOKEN] = std::array::from_fn(|slot| {
            let slot = if slot < count { slot } else { 0 };
            let at = slot * h;
            Job::expert(
                &layer.down,
                chosen[slot].0,
                &activated_q[slot],
                per_down,
                at,
            )
            .folded(per_down)
        });
        let expert_out = &mut s.expert_out[..count * h];
        s.work
            .run(self.kernels, self.team, &jobs[..count], expert_out);
        for (slot, &(expert, weight)) in chosen.iter().enumerate() {
            let y = &mut s.expert_out[slot * h..(slot + 1) * h];
            add_bias_rows(y, layer.down.bias(expert));
            add_weighted(&mut s.moe_out[..h], weight, y);
        }
    }

    /// The tokens of a chunk routed to `expert`, multiplied together so each weight tile is
    /// decoded once for all of them.
    pub(super) fn prefill_expert(&self, layer: &Layer, expert: usize, s: &mut Scratch) {
        let c = self.config;
        let (h, inter) = (c.hidden_size, c.intermediate_size);
        let ExpertRows {
            per_gate_up,
            down_split,
            per_down,
        } = self.expert_rows();
        let routes = &s.routes[expert];
        let m = routes.len();

        s.route_rows.clear();
        for &(i, _) in routes {
            s.route_rows.extend(per_gate_up * i..per_gate_up * (i + 1));
        }
        s.gathered
            .gather_rows(&s.expert_in_q, &s.route_rows)
            .expect("routed rows are chunk rows");
        let job = Job::expert(&layer.gate_up, expert, &s.gathered, per_gate_up * m, 0)
            .folded(per_gate_up);
        let gate_up = &mut s.gate_up[..m * 2 * inter];
        s.work.run(self.kernels, self.team, &[job], gate_up);
        let activated = &mut s.activated[..m * inter];
        self.biased_swiglu(layer, expert, gate_up, activated);

        let activated_q = &mut s.activated_q[0];
        s.work
            .quantize(self.kernels, activated, inter, down_split, activated_q);
        let job = Job::expert(&layer.down, expert, activated_q, per_down * m, 0).folded(per_down);
        let expert_out = &mut s.expert_out[..m * h];
        s.work.run(self.kernels, self.team, &[job], expert_out);
        for (y, &(i, weight)) in expert_out.chunks_exact_mut(h).zip(routes) {
            add_bias_rows(y, layer.down.bias(expert));
            add_weighted(&mut s.moe_out[i * h..(i + 1) * h], weight, y);
        }
    }
}
