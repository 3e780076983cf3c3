//go:build node

package testcluster

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// TestNodeRunsPodsLikeARealCluster starts a cluster with a node, has the
// scheduler place a Pod of the node image on it, execs into it and
// forwards a port to it with kubectl, checks the controllers a real
// cluster runs, and then that Stop left nothing on the host: no process,
// mount, cgroup or bridge of the node.
func TestNodeRunsPodsLikeARealCluster(t *testing.T) {
	c, err := Run(t.Context(), WithNode())
	require.NoError(t, err)
	stopped := false
	t.Cleanup(func() {
		if !stopped {
			_ = c.Stop()
		}
	})
	t.Logf("cluster with a node ready in %s", c.StartDuration.Round(time.Millisecond))
	ctx := t.Context()
	kubectl, err := Binary(ctx, "", Kubectl)
	require.NoError(t, err)
	run := func(args ...string) string {
		t.Helper()
		out, err := exec.CommandContext(ctx, kubectl, append([]string{"--kubeconfig", c.KubeconfigPath}, args...)...).CombinedOutput()
		require.NoError(t, err, "kubectl %s: %s", strings.Join(args, " "), out)
		return string(out)
	}

	t.Run("the controllers of a real cluster run", func(t *testing.T) {
		_, err := c.Client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "fresh"}}, metav1.CreateOptions{})
		require.NoError(t, err)
		require.Eventually(t, func() bool {
			_, errSA := c.Client.CoreV1().ServiceAccounts("fresh").Get(ctx, "default", metav1.GetOptions{})
			cm, errCM := c.Client.CoreV1().ConfigMaps("fresh").Get(ctx, "kube-root-ca.crt", metav1.GetOptions{})
			return errSA == nil && errCM == nil && cm.Data["ca.crt"] == string(c.CAData)
		}, 30*time.Second, 100*time.Millisecond, "a new namespace gets its default ServiceAccount and kube-root-ca.crt")
		require.Eventually(t, func() bool {
			view, err := c.Client.RbacV1().ClusterRoles().Get(ctx, "view", metav1.GetOptions{})
			return err == nil && len(view.Rules) > 0
		}, 30*time.Second, 100*time.Millisecond, "the view ClusterRole is aggregated")
		require.NoError(t, c.Client.CoreV1().Namespaces().Delete(ctx, "fresh", metav1.DeleteOptions{}))
		require.Eventually(t, func() bool {
			_, err := c.Client.CoreV1().Namespaces().Get(ctx, "fresh", metav1.GetOptions{})
			return apierrors.IsNotFound(err)
		}, 60*time.Second, 200*time.Millisecond, "a deleted namespace is finalized")
	})

	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "probe", Namespace: "default"},
		Spec: corev1.PodSpec{
			AutomountServiceAccountToken: new(bool),
			Containers: []corev1.Container{{
				Name: "probe", Image: NodeImageRef, ImagePullPolicy: corev1.PullNever,
				Args: []string{"serve", "127.0.0.1:8080"}, Stdin: true,
			}},
		},
	}
	_, err = c.Client.CoreV1().Pods("default").Create(ctx, pod, metav1.CreateOptions{})
	require.NoError(t, err)
	run("wait", "--for=condition=Ready", "--timeout=60s", "pod/probe")
	got, err := c.Client.CoreV1().Pods("default").Get(ctx, "probe", metav1.GetOptions{})
	require.NoError(t, err)
	require.Equal(t, NodeName, got.Spec.NodeName, "the scheduler placed it")

	t.Run("exec", func(t *testing.T) {
		cmd := exec.CommandContext(ctx, kubectl, "--kubeconfig", c.KubeconfigPath, "exec", "-i", "probe", "--", "/nodeprobe", "cat")
		cmd.Stdin = strings.NewReader("through the kubelet\n")
		out, err := cmd.CombinedOutput()
		require.NoError(t, err, "%s", out)
		require.Equal(t, "through the kubelet\n", string(out))
	})

	t.Run("port-forward", func(t *testing.T) {
		pfCtx, cancel := context.WithCancel(ctx)
		defer cancel()
		cmd := exec.CommandContext(pfCtx, kubectl, "--kubeconfig", c.KubeconfigPath, "port-forward", "pod/probe", ":8080")
		stdout, err := cmd.StdoutPipe()
		require.NoError(t, err)
		require.NoError(t, cmd.Start())
		defer func() {
			cancel()
			_ = cmd.Wait()
		}()
		port := forwardedPort(t, stdout)
		conn, err := net.DialTimeout("tcp", net.JoinHostPort("127.0.0.1", port), 5*time.Second)
		require.NoError(t, err)
		defer func() { _ = conn.Close() }()
		_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
		_, err = io.WriteString(conn, "ping\n")
		require.NoError(t, err)
		line, err := bufio.NewReader(conn).ReadString('\n')
		require.NoError(t, err)
		require.Equal(t, "ping\n", line)
	})

	dir, cgroup, bridge, socket := c.Node.Dir, c.Node.cgroup, c.Node.bridge, c.Node.ContainerdAddress
	require.NoError(t, c.Stop())
	stopped = true

	mounts, err := mountsUnder(filepath.Dir(dir))
	require.NoError(t, err)
	require.Empty(t, mounts, "no mount is left")
	dirs, _ := cgroupDirs(cgroup)
	for _, d := range dirs {
		require.NoDirExists(t, d, "no cgroup is left")
	}
	require.Error(t, exec.Command("ip", "link", "show", bridge).Run(), "the bridge is gone")
	require.Empty(t, shimsOf(t, socket), "no shim is left")
	require.NoDirExists(t, filepath.Dir(dir))
}

var forwardingLine = regexp.MustCompile(`Forwarding from 127\.0\.0\.1:(\d+) ->`)

// forwardedPort reads kubectl port-forward's output until it names the
// local port.
func forwardedPort(t *testing.T, r io.Reader) string {
	t.Helper()
	ch := make(chan string, 1)
	go func() {
		s := bufio.NewScanner(r)
		for s.Scan() {
			if m := forwardingLine.FindStringSubmatch(s.Text()); m != nil {
				ch <- m[1]
				break
			}
		}
		_, _ = io.Copy(io.Discard, r)
	}()
	select {
	case p := <-ch:
		return p
	case <-time.After(30 * time.Second):
		t.Fatal("kubectl port-forward did not say which port it forwards")
		return ""
	}
}

// shimsOf lists the pids of containerd shims that serve socket.
func shimsOf(t *testing.T, socket string) []string {
	t.Helper()
	var out []string
	procs, err := os.ReadDir("/proc")
	require.NoError(t, err)
	for _, p := range procs {
		b, err := os.ReadFile(filepath.Join("/proc", p.Name(), "cmdline"))
		if err == nil && strings.Contains(string(b), "containerd-shim") && strings.Contains(string(b), socket) {
			out = append(out, p.Name())
		}
	}
	return out
}

// nodeHelperEnv makes the test binary run TestNodeHelperProcess: a test
// that starts a node with a Pod, prints its directory and then panics
// ("panic") or waits to be killed ("kill").
const nodeHelperEnv = "TESTCLUSTER_NODE_HELPER"

// TestNodeLeavesNothingWhenItsTestPanicsOrIsKilled runs a test with a
// node and a running Pod in a child process. When the test panics, its
// cleanup still removes everything. When the process is killed with
// SIGKILL (no cleanup runs; the kubelet and containerd die with it, the
// containers, shims and mounts do not), the next start of a node reaps
// what it left.
func TestNodeLeavesNothingWhenItsTestPanicsOrIsKilled(t *testing.T) {
	helper := func(t *testing.T, mode string) (*exec.Cmd, string) {
		t.Helper()
		cmd := exec.Command(os.Args[0], "-test.run", "^TestNodeHelperProcess$", "-test.v", "-test.count=1")
		cmd.Env = append(os.Environ(), nodeHelperEnv+"="+mode)
		stdout, err := cmd.StdoutPipe()
		require.NoError(t, err)
		require.NoError(t, cmd.Start())
		dirs := make(chan string, 1)
		go func() {
			s := bufio.NewScanner(stdout)
			for s.Scan() {
				if d, ok := strings.CutPrefix(strings.TrimSpace(s.Text()), "NODE-DIR="); ok {
					dirs <- d
				}
			}
		}()
		select {
		case d := <-dirs:
			return cmd, d
		case <-time.After(2 * time.Minute):
			_ = cmd.Process.Kill()
			t.Fatal("the helper never started its node")
			return nil, ""
		}
	}
	requireNothingLeft := func(t *testing.T, dir string) {
		t.Helper()
		mounts, err := mountsUnder(dir)
		require.NoError(t, err)
		require.Empty(t, mounts, "no mount is left")
		dirs, _ := cgroupDirs(nodeCgroup(dir))
		for _, d := range dirs {
			require.NoDirExists(t, d, "no cgroup is left")
		}
		require.Empty(t, shimsOf(t, filepath.Join(dir, nodeDirName, "containerd.sock")), "no shim is left")
		require.NoDirExists(t, dir)
	}

	t.Run("panic", func(t *testing.T) {
		cmd, dir := helper(t, "panic")
		require.Error(t, cmd.Wait(), "the helper test panics")
		requireNothingLeft(t, dir)
	})

	t.Run("SIGKILL", func(t *testing.T) {
		cmd, dir := helper(t, "kill")
		require.NoError(t, cmd.Process.Kill())
		_ = cmd.Wait()
		require.Eventually(t, func() bool {
			mounts, _ := mountsUnder(dir)
			return len(mounts) > 0 && !processAlive(cmd.Process.Pid)
		}, 10*time.Second, 100*time.Millisecond, "the killed test leaves mounts behind")
		c, err := Run(t.Context(), WithNode())
		require.NoError(t, err)
		require.NoError(t, c.Stop())
		requireNothingLeft(t, dir)
	})
}

// TestNodeHelperProcess is TestNodeLeavesNothingWhenItsTestPanicsOrIsKilled's
// child; on its own it does nothing.
func TestNodeHelperProcess(t *testing.T) {
	mode := os.Getenv(nodeHelperEnv)
	if mode == "" {
		t.Skip("the child of TestNodeLeavesNothingWhenItsTestPanicsOrIsKilled")
	}
	c := Start(t, WithNode())
	_, err := c.Client.CoreV1().Pods("default").Create(t.Context(), &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "probe", Namespace: "default"},
		Spec: corev1.PodSpec{
			AutomountServiceAccountToken: new(bool),
			Containers:                   []corev1.Container{{Name: "probe", Image: NodeImageRef, ImagePullPolicy: corev1.PullNever}},
		},
	}, metav1.CreateOptions{})
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		p, err := c.Client.CoreV1().Pods("default").Get(t.Context(), "probe", metav1.GetOptions{})
		return err == nil && p.Status.Phase == corev1.PodRunning
	}, time.Minute, 100*time.Millisecond)
	fmt.Printf("NODE-DIR=%s\n", c.Dir)
	if mode == "panic" {
		panic("a test with a node panics")
	}
	select {}
}

// TestNodeTeardownKillsAFrozenContainer freezes a process in a cgroup of
// the node's kind, as runc does while it kills a container, and checks
// that the teardown still kills it and removes the cgroup: a runc killed
// mid-way would otherwise leave its container frozen and unkillable.
func TestNodeTeardownKillsAFrozenContainer(t *testing.T) {
	cgroup := fmt.Sprintf("/%sfrozen-%d", cgroupNamePrefix, os.Getpid())
	v1, err := makeCgroups(cgroup)
	require.NoError(t, err)
	t.Cleanup(func() { killCgroup(cgroup); _ = removeCgroups(cgroup) })
	container := filepath.Join(cgroup, "pod", "container")
	_, err = makeCgroups(container)
	require.NoError(t, err)

	sleep := exec.Command("sleep", "600")
	require.NoError(t, sleep.Start())
	exited := make(chan error, 1)
	go func() { exited <- sleep.Wait() }()
	// Into the freezer's hierarchy (v1), or the one tree (v2), and frozen.
	freeze, frozen := "freezer.state", "FROZEN"
	if !v1 {
		freeze, frozen = "cgroup.freeze", "1"
	}
	dirs, _ := cgroupDirs(container)
	var froze bool
	for _, d := range dirs {
		if f := filepath.Join(d, freeze); isFile(f) {
			require.NoError(t, os.WriteFile(filepath.Join(d, "cgroup.procs"), []byte(fmt.Sprint(sleep.Process.Pid)), 0o644))
			require.NoError(t, os.WriteFile(f, []byte(frozen), 0o644))
			froze = true
		}
	}
	require.True(t, froze, "no freezer for %s", container)
	require.NoError(t, sleep.Process.Kill())
	select {
	case <-exited:
		t.Fatal("a frozen process died of SIGKILL: the freezer did not hold it")
	case <-time.After(300 * time.Millisecond):
	}

	killCgroup(cgroup)
	select {
	case <-exited:
	case <-time.After(10 * time.Second):
		t.Fatal("the frozen process is still there after the teardown")
	}
	require.NoError(t, removeCgroups(cgroup))
	for _, d := range dirs {
		require.NoDirExists(t, d)
	}
}
