#include "parallel/parallel_group.h"

#include "core/log.h"

namespace ml4 {

Result<std::unique_ptr<ParallelGroup>> ParallelGroup::create(const ParallelConfig& config, const ModelConfig& model) {
  ML4_RETURN_IF_ERROR(config.validate());
  ML4_ASSIGN_OR_RETURN(MpiEnv * env, MpiEnv::init());
  auto g = std::make_unique<ParallelGroup>();
  g->env = env;
  ML4_ASSIGN_OR_RETURN(g->layout, RankLayout::make(config, env->size(), env->rank()));
  ML4_ASSIGN_OR_RETURN(ParallelPlan plan, ParallelPlan::make(model, g->layout));
  g->plan = std::make_unique<ParallelPlan>(std::move(plan));
  // The world's control channel, the TP group (color: the DP replica), the EP group.
  ML4_ASSIGN_OR_RETURN(MPI_Comm world, env->split(0, env->rank()));
  g->world = std::make_unique<MpiCommunicator>(env, world);
  ML4_ASSIGN_OR_RETURN(MPI_Comm tp, env->split(env->rank() / g->layout.tp_size, g->layout.tp_rank));
  g->tp = std::make_unique<MpiCommunicator>(env, tp);
  ML4_ASSIGN_OR_RETURN(MPI_Comm ep, env->split(config.enable_expert_parallel ? 0 : env->rank(), env->rank()));
  g->ep = std::make_unique<MpiCommunicator>(env, ep);
  // DCP groups are runs of dcp consecutive world ranks (rank_layout.h).
  ML4_ASSIGN_OR_RETURN(MPI_Comm dcp, env->split(env->rank() / g->layout.dcp_size, g->layout.dcp_rank));
  g->dcp = std::make_unique<MpiCommunicator>(env, dcp);
  // PCP groups: the ranks of one DP replica with one TP rank.
  ML4_ASSIGN_OR_RETURN(MPI_Comm pcp, env->split(g->layout.dp_rank * g->layout.tp_size + g->layout.tp_rank,
                                                g->layout.pcp_rank));
  g->pcp = std::make_unique<MpiCommunicator>(env, pcp);
  if (g->is_driver()) {
    std::string hosts;
    for (int r = 0; r < env->size(); ++r) hosts += fmt::format(" {}:{}", env->host_of(r), env->pid_of(r));
    ML4_LOG_INFO("{}  processes (host:pid):{}", g->layout.describe(), hosts);
  }
  return g;
}

}  // namespace ml4
