package testcluster

// APIServerPID is the process id of the running kube-apiserver, 0 if it
// is stopped: for a benchmark that reads its CPU time from /proc.
func (c *Cluster) APIServerPID() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.apiserver == nil || c.apiserver.cmd.Process == nil {
		return 0
	}
	return c.apiserver.cmd.Process.Pid
}
