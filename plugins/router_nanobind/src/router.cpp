#include "router.h"

#include <algorithm>
#include <utility>

namespace laya {

UnknownReplica::UnknownReplica(std::int64_t replica)
    : std::out_of_range("unknown replica " + std::to_string(replica)), replica(replica) {}

void Router::add_replica(const std::string& model, std::int64_t replica, std::int64_t weight) {
    // Checked in PythonRouter's order, so the same bad call raises the same error.
    if (replica < 0)
        throw std::invalid_argument("replica ids are >= 0, got " + std::to_string(replica));
    if (weight < 1)
        throw std::invalid_argument("weight must be >= 1, got " + std::to_string(weight));
    std::lock_guard<std::mutex> lock(mutex_);
    if (replicas_.count(replica) != 0)
        throw std::invalid_argument("replica " + std::to_string(replica) + " already exists");
    pools_[model].replicas.push_back(replica);  // a new model starts with cursor 0
    replicas_[replica] = Replica{model, ReplicaState::Up, 0, weight};
}

void Router::remove_replica(std::int64_t replica) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto found = replicas_.find(replica);
    if (found == replicas_.end())
        throw UnknownReplica(replica);
    auto pool_it = pools_.find(found->second.model);
    Pool& pool = pool_it->second;
    auto position = std::find(pool.replicas.begin(), pool.replicas.end(), replica);
    auto index = static_cast<std::size_t>(position - pool.replicas.begin());
    pool.replicas.erase(position);
    // Keep the cursor on the same next replica: everything after `index` moved left by one.
    if (index < pool.cursor)
        --pool.cursor;
    if (pool.replicas.empty())
        pools_.erase(pool_it);
    else if (pool.cursor >= pool.replicas.size())
        pool.cursor = 0;
    replicas_.erase(found);
}

void Router::set_state(std::int64_t replica, int state) {
    std::lock_guard<std::mutex> lock(mutex_);
    Replica& entry = replica_at(replica);  // unknown id before bad state, as in Python
    if (state < 0 || state > static_cast<int>(ReplicaState::Down))
        throw std::invalid_argument(std::to_string(state) + " is not a valid ReplicaState");
    entry.state = static_cast<ReplicaState>(state);
}

std::int64_t Router::route(const std::string& model) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto pool_it = pools_.find(model);
    if (pool_it == pools_.end())
        throw NoRoute("no model named '" + model + "'");
    Pool& pool = pool_it->second;
    const std::size_t num_replicas = pool.replicas.size();
    // Scan once around the pool from the cursor; strict `<` keeps the first of equal loads,
    // which is what makes ties go round robin.
    Replica* best = nullptr;
    std::size_t best_index = 0;
    for (std::size_t offset = 0; offset < num_replicas; ++offset) {
        std::size_t index = (pool.cursor + offset) % num_replicas;
        Replica& candidate = replicas_.at(pool.replicas[index]);
        if (candidate.state != ReplicaState::Up)
            continue;
        if (best == nullptr || candidate.num_outstanding < best->num_outstanding) {
            best = &candidate;
            best_index = index;
        }
    }
    if (best == nullptr)
        throw NoRoute("model '" + model + "' has no replica up");
    pool.cursor = (best_index + 1) % num_replicas;
    ++best->num_outstanding;
    return pool.replicas[best_index];
}

void Router::release(std::int64_t replica) {
    std::lock_guard<std::mutex> lock(mutex_);
    Replica& entry = replica_at(replica);
    if (entry.num_outstanding == 0)
        throw std::invalid_argument("replica " + std::to_string(replica) +
                                    " has no outstanding request to release");
    --entry.num_outstanding;
}

std::int64_t Router::outstanding(std::int64_t replica) const {
    std::lock_guard<std::mutex> lock(mutex_);
    return replica_at(replica).num_outstanding;
}

const Router::Replica& Router::replica_at(std::int64_t replica) const {
    auto found = replicas_.find(replica);
    if (found == replicas_.end())
        throw UnknownReplica(replica);
    return found->second;
}

Router::Replica& Router::replica_at(std::int64_t replica) {
    return const_cast<Replica&>(std::as_const(*this).replica_at(replica));
}

}  // namespace laya
