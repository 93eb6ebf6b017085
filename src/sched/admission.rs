//! Admission control across lanes: whether the engine takes one more request of a lane or answers
//! 429. A request is refused only when neither a sequence slot nor its lane's queue can hold it:
//! the engine accepts `max_num_seqs` requests whatever their lanes (a burst of that size is taken
//! whole), and beyond that each lane queues up to its `max_queue`.
//!
//! Which accepted requests hold the slots follows the scheduler's order: higher priority first,
//! so a lane's *waiting* count is what is left of it after every lane above it took its slots.
//! A voice request is therefore accepted while agents fill every slot (it will preempt one), and
//! agents count as waiting behind it. Plain data; the engine keeps it behind a mutex that HTTP
//! handlers take to accept and the scheduler takes when a request ends.

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaneQueue {
    pub priority: i32,
    /// Waiting requests the lane may hold beyond the sequence slots.
    pub max_queue: usize,
}

/// Why a request was refused: its lane's queue is full and every slot is taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueFull {
    pub capacity: usize,
}

#[derive(Debug, Clone)]
pub struct Admission {
    lanes: Vec<LaneQueue>,
    /// Lane indices, highest priority first (ties in configuration order).
    order: Vec<usize>,
    max_num_seqs: usize,
    /// Accepted requests per lane that have not ended.
    live: Vec<usize>,
}

impl Admission {
    pub fn new(lanes: Vec<LaneQueue>, max_num_seqs: usize) -> Self {
        let mut order: Vec<usize> = (0..lanes.len()).collect();
        order.sort_by_key(|&i| std::cmp::Reverse(lanes[i].priority));
        Admission { live: vec![0; lanes.len()], lanes, order, max_num_seqs }
    }

    /// Accepts one more request of `lane` (counted until `release`), or refuses it.
    pub fn try_admit(&mut self, lane: usize) -> Result<(), QueueFull> {
        let capacity = self.lanes.get(lane).map_or(0, |l| l.max_queue);
        if lane >= self.live.len() {
            return Err(QueueFull { capacity });
        }
        self.live[lane] += 1;
        if self.waiting(lane) > capacity {
            self.live[lane] -= 1;
            return Err(QueueFull { capacity });
        }
        Ok(())
    }

    /// An accepted request of `lane` ended (finished, failed or cancelled).
    pub fn release(&mut self, lane: usize) {
        if let Some(n) = self.live.get_mut(lane) {
            debug_assert!(*n > 0, "released more requests of lane {lane} than were accepted");
            *n = n.saturating_sub(1);
        }
    }

    /// Accepted requests of `lane` that have not ended.
    pub fn live(&self, lane: usize) -> usize {
        self.live.get(lane).copied().unwrap_or(0)
    }

    /// Requests of `lane` beyond the slots that the lanes above it and itself take.
    pub fn waiting(&self, lane: usize) -> usize {
        let mut slots = self.max_num_seqs;
        for &i in &self.order {
            let running = self.live[i].min(slots);
            if i == lane {
                return self.live[i] - running;
            }
            slots -= running;
        }
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// voice (priority 10, queue 4) and agent (priority 0, queue 8), 6 sequence slots.
    fn admission() -> Admission {
        Admission::new(vec![LaneQueue { priority: 10, max_queue: 4 }, LaneQueue { priority: 0, max_queue: 8 }], 6)
    }

    #[test]
    fn a_burst_of_max_num_seqs_is_accepted_whole_even_above_the_lane_queue() {
        let mut a = Admission::new(vec![LaneQueue { priority: 10, max_queue: 2 }], 96);
        for i in 0..96 {
            assert_eq!(a.try_admit(0), Ok(()), "request {i} of the burst");
        }
        assert_eq!(a.waiting(0), 0);
        // Then the queue: two more wait, the third is refused.
        assert_eq!((a.try_admit(0), a.try_admit(0)), (Ok(()), Ok(())));
        assert_eq!(a.try_admit(0), Err(QueueFull { capacity: 2 }));
        assert_eq!((a.live(0), a.waiting(0)), (98, 2));
        // One ends: room for exactly one more.
        a.release(0);
        assert_eq!(a.try_admit(0), Ok(()));
        assert_eq!(a.try_admit(0), Err(QueueFull { capacity: 2 }));
    }

    #[test]
    fn voice_is_accepted_while_agents_fill_every_slot_and_agents_then_wait_behind_it() {
        let mut a = admission();
        for _ in 0..6 + 8 {
            a.try_admit(1).unwrap();
        }
        assert_eq!(a.try_admit(1), Err(QueueFull { capacity: 8 }), "slots and agent queue full");
        assert_eq!(a.waiting(1), 8);
        // Voice takes slots first: 4 voice requests are accepted and none of them waits.
        for _ in 0..4 {
            a.try_admit(0).unwrap();
        }
        assert_eq!((a.waiting(0), a.waiting(1)), (0, 12));
        // Six voice requests hold every slot; four more wait in the voice queue, then 429.
        for _ in 0..2 + 4 {
            a.try_admit(0).unwrap();
        }
        assert_eq!(a.try_admit(0), Err(QueueFull { capacity: 4 }));
        assert_eq!((a.waiting(0), a.waiting(1)), (4, 14));
        assert_eq!(a.try_admit(1), Err(QueueFull { capacity: 8 }));
    }

    #[test]
    fn releasing_frees_capacity_and_unknown_lanes_are_refused() {
        let mut a = admission();
        for _ in 0..6 + 8 {
            a.try_admit(1).unwrap();
        }
        for _ in 0..3 {
            a.release(1);
        }
        for _ in 0..3 {
            a.try_admit(1).unwrap();
        }
        assert!(a.try_admit(1).is_err());
        assert!(a.try_admit(7).is_err());
    }
}
