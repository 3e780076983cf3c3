//go:build node

package e2e

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os/exec"
	"path/filepath"
	"regexp"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/test/testcluster"
)

// TestNodeStreamsOutliveARevocationInDirectMode measures, on a real
// kubelet, what docs/security.md ("Revocation and open streams") says: an
// exec session (over WebSocket, kubectl's default, and over SPDY), an
// attach and a port-forward opened with a brokered credential before its
// lease is revoked go on working after every new request with it is
// refused; a port-forward even opens new connections into the Pod. Nor
// does the kubelet's streamingConnectionIdleTimeout end them (4 h by
// default, 15 s here): client-go pings every 5 s (exec, attach) or 10 s
// (port-forward), so a session kubectl holds open is never idle. Only the
// gateway (or the client, the Pod, a kubelet restart) ends them.
func TestNodeStreamsOutliveARevocationInDirectMode(t *testing.T) {
	const idle = 15 * time.Second   // above client-go's ping periods: 5 s (exec, attach), 10 s (port-forward)
	const window = 15 * time.Second // how long the streams are used after the refusal
	c := testcluster.Start(t, testcluster.WithNode(), testcluster.WithStreamingIdleTimeout(idle))
	setUpTarget(t, c)
	ctx := t.Context()
	kubectl := kubectlBinary(t)
	grantPodStreams(t, c)
	startProbePod(t, c, kubectl, "argo", "probe")

	e := startBroker(t, c)
	status, body := e.postKubeconfig(t, filepath.Join(e.dir, "west"), `{"namespace":"argo","serviceAccount":"runner","ttl":"1h"}`)
	require.Equal(t, 201, status, body)
	var lease apiv1.KubeconfigResponse
	require.NoError(t, json.Unmarshal([]byte(body), &lease))
	kc := writeFile(t, filepath.Join(t.TempDir(), "lease.kubeconfig"), lease.Kubeconfig)

	execSession := startStream(t, kubectl, "--kubeconfig", kc, "-n", "argo", "exec", "-i", "probe", "--", "/nodeprobe", "cat")
	t.Setenv("KUBECTL_REMOTE_COMMAND_WEBSOCKETS", "false") // the SPDY exec kubectl used before 1.31
	spdySession := startStream(t, kubectl, "--kubeconfig", kc, "-n", "argo", "exec", "-i", "probe", "--", "/nodeprobe", "cat")
	attachSession := startStream(t, kubectl, "--kubeconfig", kc, "-n", "argo", "attach", "-i", "probe")
	pf := startPortForward(t, kubectl, "--kubeconfig", kc, "-n", "argo", "port-forward", "pod/probe", ":8080")
	conn := pf.dial(t)
	for _, s := range []interface{ echo(string) error }{execSession, spdySession, attachSession, conn} {
		require.NoError(t, s.echo("before the revocation"))
	}

	run(t, e.bin, "leases", "revoke", "-n", "argo", lease.LeaseID, "--kubeconfig", c.KubeconfigPath)
	revoked := time.Now()
	brokered, err := kubernetes.NewForConfig(c.TokenConfig(lease.Token))
	require.NoError(t, err)
	refused := whenRefused(t, func() error {
		_, err := brokered.CoreV1().Pods("argo").List(ctx, metav1.ListOptions{})
		return err
	})
	out, err := exec.CommandContext(ctx, kubectl, "--kubeconfig", kc, "-n", "argo", "exec", "probe", "--", "/nodeprobe", "cat").CombinedOutput()
	require.Error(t, err, "a new exec is refused: %s", out)

	// Every stream opened before goes on, and the port-forward opens new
	// connections into the Pod.
	for time.Since(refused) < window {
		for name, s := range map[string]interface{ echo(string) error }{"exec (WebSocket)": execSession, "exec (SPDY)": spdySession, "attach": attachSession, "port-forward": conn, "a new port-forward connection": pf.dial(t)} {
			require.NoError(t, s.echo("after the revocation"), "%s, %s after the refusal", name, time.Since(refused).Round(time.Second))
		}
		time.Sleep(2 * time.Second)
	}
	usable := time.Since(revoked)

	// Left without data for longer than the idle timeout, they are not
	// idle to the kubelet: client-go pings every 5 s (exec and attach, SPDY
	// and the WebSocket heartbeat alike) or 10 s (port-forward), so they
	// still work.
	time.Sleep(idle + 10*time.Second)
	for name, s := range map[string]interface{ echo(string) error }{"exec (WebSocket)": execSession, "exec (SPDY)": spdySession, "attach": attachSession, "port-forward": conn} {
		require.NoError(t, s.echo("after the idle timeout"), "%s, unused for %s (idle timeout %s)", name, idle+10*time.Second, idle)
	}
	t.Logf("new requests refused %s after the revocation; exec (WebSocket and SPDY), attach and port-forward (old and new connections) still worked %s after it, and again after %s unused (streamingConnectionIdleTimeout %s)",
		refused.Sub(revoked).Round(100*time.Millisecond), usable.Round(100*time.Millisecond), idle+10*time.Second, idle)
}

// startProbePod runs the node image's probe (serving an echo on
// 127.0.0.1:8080 in the Pod, stdin copied to stdout) in ns and waits until
// it is Ready.
func startProbePod(t *testing.T, c *testcluster.Cluster, kubectl, ns, name string) {
	t.Helper()
	_, err := c.Client.CoreV1().Pods(ns).Create(t.Context(), &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: corev1.PodSpec{
			AutomountServiceAccountToken: ptrTo(false),
			Containers: []corev1.Container{{
				Name: "probe", Image: testcluster.NodeImageRef, ImagePullPolicy: corev1.PullNever,
				Args: []string{"serve", "127.0.0.1:8080"}, Stdin: true,
			}},
		},
	}, metav1.CreateOptions{})
	require.NoError(t, err)
	run(t, kubectl, "--kubeconfig", c.KubeconfigPath, "-n", ns, "wait", "--for=condition=Ready", "--timeout=60s", "pod/"+name)
}

// stream is a kubectl exec or attach whose standard input reaches a
// program that copies it to its standard output.
type stream struct {
	stdin io.WriteCloser
	lines chan string
	done  chan struct{} // closed when kubectl has exited
}

func startStream(t *testing.T, kubectl string, args ...string) *stream {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	cmd := exec.CommandContext(ctx, kubectl, args...)
	stdin, err := cmd.StdinPipe()
	require.NoError(t, err)
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	s := &stream{stdin: stdin, lines: make(chan string, 16), done: make(chan struct{})}
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			s.lines <- sc.Text()
		}
		_ = cmd.Wait()
		close(s.done)
	}()
	t.Cleanup(func() {
		cancel()
		<-s.done
	})
	return s
}

// echo sends line and waits for it to come back.
func (s *stream) echo(line string) error {
	if _, err := io.WriteString(s.stdin, line+"\n"); err != nil {
		return err
	}
	deadline := time.After(10 * time.Second)
	for {
		select {
		case got := <-s.lines:
			if got == line {
				return nil
			}
		case <-s.done:
			return errors.New("the stream has ended")
		case <-deadline:
			return fmt.Errorf("%q did not come back within 10s", line)
		}
	}
}

// portForward is a running kubectl port-forward.
type portForward struct{ port string }

var forwardingFrom = regexp.MustCompile(`Forwarding from 127\.0\.0\.1:(\d+) ->`)

func startPortForward(t *testing.T, kubectl string, args ...string) *portForward {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	cmd := exec.CommandContext(ctx, kubectl, args...)
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	done := make(chan struct{})
	t.Cleanup(func() {
		cancel()
		<-done
	})
	ports := make(chan string, 1)
	go func() {
		defer close(done)
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			if m := forwardingFrom.FindStringSubmatch(sc.Text()); m != nil {
				select {
				case ports <- m[1]:
				default:
				}
			}
		}
		_ = cmd.Wait()
	}()
	select {
	case p := <-ports:
		return &portForward{port: p}
	case <-time.After(30 * time.Second):
		t.Fatal("kubectl port-forward did not say which port it forwards")
		return nil
	}
}

// dial opens a connection through the port-forward (a new stream to the
// kubelet on kubectl's one connection).
func (p *portForward) dial(t *testing.T) *echoConn {
	t.Helper()
	c, err := net.DialTimeout("tcp", net.JoinHostPort("127.0.0.1", p.port), 5*time.Second)
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	return &echoConn{c: c, r: bufio.NewReader(c)}
}

// echoConn is a connection to the probe's echo server.
type echoConn struct {
	c net.Conn
	r *bufio.Reader
}

func (e *echoConn) echo(line string) error {
	_ = e.c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.WriteString(e.c, line+"\n"); err != nil {
		return err
	}
	got, err := e.r.ReadString('\n')
	if err != nil {
		return err
	}
	if got != line+"\n" {
		return fmt.Errorf("got %q back, want %q", got, line)
	}
	return nil
}

// grantPodStreams lets argo/runner list Pods in argo and exec, attach and
// port-forward into them.
func grantPodStreams(t *testing.T, c *testcluster.Cluster) {
	t.Helper()
	ctx := t.Context()
	_, err := c.Client.RbacV1().Roles("argo").Create(ctx, &rbacv1.Role{
		ObjectMeta: metav1.ObjectMeta{Name: "pod-streams"},
		Rules: []rbacv1.PolicyRule{
			{APIGroups: []string{""}, Resources: []string{"pods"}, Verbs: []string{"get", "list"}},
			{APIGroups: []string{""}, Resources: []string{"pods/exec", "pods/attach", "pods/portforward"}, Verbs: []string{"get", "create"}},
		},
	}, metav1.CreateOptions{})
	require.NoError(t, err)
	_, err = c.Client.RbacV1().RoleBindings("argo").Create(ctx, &rbacv1.RoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: "runner-streams"},
		RoleRef:    rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "Role", Name: "pod-streams"},
		Subjects:   []rbacv1.Subject{{Kind: "ServiceAccount", Name: "runner", Namespace: "argo"}},
	}, metav1.CreateOptions{})
	require.NoError(t, err)
}
