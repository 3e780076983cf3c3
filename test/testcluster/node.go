package testcluster

import (
	"context"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"fmt"
	"hash/fnv"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
)

// NodeName is the name of the node WithNode starts. The API server reaches
// the kubelet by the node's Hostname address (--kubelet-preferred-address-
// types=Hostname), and "localhost" is the one name that resolves to the
// loopback address everywhere: the kubelet listens on 127.0.0.1 only.
const NodeName = "localhost"

// NodeImageRef is the image every pod sandbox of the node runs ("pause")
// and the stream tests run: test/image's nodeprobe, built by the project
// (make node-image) and imported into the node's containerd, never pulled.
const NodeImageRef = "localhost/tokenbroker-test/node:v1"

// ContainerdNamespace is the containerd namespace the kubelet's pods live
// in; Node.ImportImage imports into it.
const ContainerdNamespace = "k8s.io"

const (
	nodeDirName      = "node"
	nodeOwnerFile    = "owner" // the pid of the process that started the node
	nodeImageFile    = "node-image.tar"
	containerdLog    = "containerd.log"
	kubeletLog       = "kubelet.log"
	schedulerLog     = "kube-scheduler.log"
	cgroupRoot       = "/sys/fs/cgroup"
	cgroupNamePrefix = "tokenbroker-"
	// DefaultStreamingIdleTimeout is the kubelet's own default for how long
	// an exec, attach or port-forward stream may sit idle before the
	// kubelet closes it.
	DefaultStreamingIdleTimeout = 4 * time.Hour
)

// Node is the node of a cluster started WithNode: a kubelet with containerd
// and runc from the host's packages, and a kube-scheduler. Its pods run in
// their own network namespace on a bridge that has no address on the host
// (so nothing reaches them but the kubelet's streams: exec, attach,
// port-forward), or on the host's network with hostNetwork, where they
// reach the API server on 127.0.0.1 like every other test client.
type Node struct {
	// Name is NodeName.
	Name string
	// Dir holds containerd's and the kubelet's state and logs (in the
	// cluster's Dir).
	Dir string
	// ContainerdAddress is the socket of the node's containerd.
	ContainerdAddress string
	// CgroupV1 says the host has cgroup v1 hierarchies: then the kubelet
	// runs with failCgroupV1: false (it refuses v1 otherwise since 1.35).
	CgroupV1 bool

	c          *Cluster
	cgroup     string // the kubelet's cgroupRoot, e.g. /tokenbroker-testcluster-123
	bridge     string
	kubeletBin string
	schedBin   string
	containerd *process
	kubelet    *process
	scheduler  *process
}

// nodeHostTools are the host's programs a node needs, and the Debian
// packages that have them.
var nodeHostTools = map[string]string{"containerd": "containerd", "runc": "runc", "ctr": "containerd", "ip": "iproute2"}

// cniDirs are where Debian (containernetworking-plugins) and the CNI
// project's own releases put the plugins.
var cniDirs = []string{"/usr/lib/cni", "/opt/cni/bin"}

// checkNodeHost says what this host lacks for a node, or nil.
func checkNodeHost() (cniDir string, err error) {
	var missing []string
	if os.Geteuid() != 0 {
		missing = append(missing, "root (containerd, runc and the kubelet mount file systems and make cgroups)")
	}
	for tool, pkg := range nodeHostTools {
		if _, err := exec.LookPath(tool); err != nil {
			missing = append(missing, tool+" (Debian package "+pkg+")")
		}
	}
	for _, d := range cniDirs {
		if isFile(filepath.Join(d, "bridge")) && isFile(filepath.Join(d, "host-local")) && isFile(filepath.Join(d, "loopback")) {
			cniDir = d
			break
		}
	}
	if cniDir == "" {
		missing = append(missing, "the CNI plugins bridge, host-local and loopback in "+strings.Join(cniDirs, " or ")+" (Debian package containernetworking-plugins)")
	}
	if len(missing) > 0 {
		return "", fmt.Errorf("a node needs %s", strings.Join(missing, ", "))
	}
	return cniDir, nil
}

// nodeBinaries resolves (building if missing) the kubelet, the scheduler
// and the node image.
func (c *Cluster) nodeBinaries(ctx context.Context) (*Node, error) {
	n := &Node{Name: NodeName, c: c}
	var err error
	if n.kubeletBin, err = Binary(ctx, c.opts.binDir, Kubelet); err != nil {
		return nil, err
	}
	if n.schedBin, err = Binary(ctx, c.opts.binDir, KubeScheduler); err != nil {
		return nil, err
	}
	return n, nil
}

// startNode starts containerd, imports the node image, and starts the
// kubelet and the scheduler; it returns once the node is Ready. The API
// server already runs with the node's flags (nodeAPIServerArgs).
func (c *Cluster) startNode(ctx context.Context, n *Node) error {
	cniDir, err := checkNodeHost()
	if err != nil {
		return err
	}
	image, err := NodeImage(ctx, c.opts.binDir)
	if err != nil {
		return err
	}
	n.Dir = filepath.Join(c.Dir, nodeDirName)
	n.ContainerdAddress = filepath.Join(n.Dir, "containerd.sock")
	n.cgroup, n.bridge = nodeCgroup(c.Dir), nodeBridge(c.Dir)
	if err := os.MkdirAll(n.Dir, 0o700); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(n.Dir, nodeOwnerFile), []byte(strconv.Itoa(os.Getpid())), 0o600); err != nil {
		return err
	}
	c.node = n // from here on, teardown cleans up after it
	if n.CgroupV1, err = makeCgroups(n.cgroup); err != nil {
		return err
	}
	if err := n.startContainerd(ctx, cniDir); err != nil {
		return err
	}
	if err := n.ImportImage(ctx, image); err != nil {
		return err
	}
	if err := n.startKubelet(ctx); err != nil {
		return err
	}
	if err := n.startScheduler(ctx); err != nil {
		return err
	}
	return n.waitReady(ctx)
}

// nodeAPIServerArgs are the API server's flags for a cluster with a node:
// the Node authorizer and NodeRestriction (so the kubelet acts only for its
// own node and pods, as on a real cluster), and the client certificate
// and address it reaches the kubelet with, verifying its serving
// certificate against the cluster CA.
func (c *Cluster) nodeAPIServerArgs() []string {
	file := func(name string) string { return filepath.Join(c.Dir, name) }
	return []string{
		"--enable-admission-plugins=NodeRestriction",
		"--kubelet-client-certificate=" + file(kubeletClientCertFile),
		"--kubelet-client-key=" + file(kubeletClientKeyFile),
		"--kubelet-certificate-authority=" + file(caCertFile),
		"--kubelet-preferred-address-types=Hostname",
	}
}

func (n *Node) path(name string) string { return filepath.Join(n.Dir, name) }

// startContainerd writes containerd's configuration (everything under
// n.Dir, so that several nodes share a host) and starts it.
func (n *Node) startContainerd(ctx context.Context, cniDir string) error {
	cni := n.path("cni")
	if err := os.MkdirAll(cni, 0o700); err != nil {
		return err
	}
	// A bridge with no address on the host and no masquerading: each pod
	// gets an interface (containerd wants one), and no route leads
	// anywhere, so the same subnet can be used by every node.
	conflist := fmt.Sprintf(`{"cniVersion":"0.4.0","name":"tokenbroker-test","plugins":[`+
		`{"type":"bridge","bridge":%q,"isGateway":false,"ipMasq":false,`+
		`"ipam":{"type":"host-local","ranges":[[{"subnet":"10.244.0.0/24"}]],"dataDir":%q}},`+
		`{"type":"loopback"}]}`, n.bridge, n.path("ipam"))
	if err := os.WriteFile(filepath.Join(cni, "10-tokenbroker-test.conflist"), []byte(conflist), 0o600); err != nil {
		return err
	}
	// restrict_oom_score_adj: runc may not lower a process's OOM score
	// below containerd's own where the host withholds CAP_SYS_RESOURCE
	// (these machines do; runc then fails with "can't get final child's
	// PID from pipe"). netns_mounts_under_state_dir keeps the pods'
	// network namespaces under n.Dir, where teardown finds them.
	config := fmt.Sprintf(`version = 2
root = %q
state = %q
[grpc]
  address = %q
[ttrpc]
  address = %q
[metrics]
  address = ""
[plugins."io.containerd.internal.v1.opt"]
  path = %q
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = %q
  stream_idle_timeout = %q
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = %q
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = %q
    conf_dir = %q
`, n.path("containerd-root"), n.path("containerd-state"), n.ContainerdAddress, n.ContainerdAddress+".ttrpc",
		n.path("opt"), NodeImageRef, n.streamingIdleTimeout().String(), n.path("runc"), cniDir, cni)
	if err := os.WriteFile(n.path("containerd.toml"), []byte(config), 0o600); err != nil {
		return err
	}
	p, err := startProcess("containerd", "containerd", []string{"--config", n.path("containerd.toml")}, n.path(containerdLog))
	if err != nil {
		return err
	}
	n.containerd = p
	for {
		if gone, err := p.exited(); gone {
			return fmt.Errorf("containerd exited: %w\n--- tail of %s ---\n%s", err, containerdLog, p.logTail())
		}
		if _, err := n.ctr(ctx, "version"); err == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("containerd not ready: %w\n--- tail of %s ---\n%s", ctx.Err(), containerdLog, p.logTail())
		case <-time.After(pollInterval):
		}
	}
}

// ctr runs containerd's client against the node's containerd, in the
// kubelet's namespace.
func (n *Node) ctr(ctx context.Context, args ...string) ([]byte, error) {
	cmd := exec.CommandContext(ctx, "ctr", append([]string{"--address", n.ContainerdAddress, "--namespace", ContainerdNamespace}, args...)...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return out, fmt.Errorf("ctr %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return out, nil
}

// ImportImage imports an image archive (docker-archive or OCI layout
// tarball, as make image and make node-image write them) into the node's
// containerd, where pods with imagePullPolicy Never find it by the
// reference the archive names.
func (n *Node) ImportImage(ctx context.Context, archive string) error {
	_, err := n.ctr(ctx, "images", "import", "--no-unpack=false", archive)
	return err
}

// streamingIdleTimeout is how long an exec, attach or port-forward stream
// may be idle: the kubelet proxies each to containerd's streaming server,
// and both have the setting.
func (n *Node) streamingIdleTimeout() time.Duration {
	if d := n.c.opts.streamingIdleTimeout; d > 0 {
		return d
	}
	return DefaultStreamingIdleTimeout
}

// startKubelet writes the kubelet's configuration and starts it.
func (n *Node) startKubelet(ctx context.Context) error {
	c := n.c
	port, err := freePort()
	if err != nil {
		return err
	}
	idle := n.streamingIdleTimeout()
	var failCgroupV1 string
	if n.CgroupV1 {
		// Since 1.35 the kubelet refuses cgroup v1 unless told not to.
		failCgroupV1 = "failCgroupV1: false\n"
	}
	config := fmt.Sprintf(`apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
%scgroupDriver: cgroupfs
cgroupRoot: %s
containerRuntimeEndpoint: unix://%s
address: 127.0.0.1
port: %d
readOnlyPort: 0
healthzPort: 0
tlsCertFile: %s
tlsPrivateKeyFile: %s
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: %s}
authorization:
  mode: Webhook
podLogsDir: %s
streamingConnectionIdleTimeout: %s
failSwapOn: false
evictionHard: {}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
localStorageCapacityIsolation: false
resolvConf: ""
serializeImagePulls: false
hairpinMode: none
protectKernelDefaults: false
makeIPTablesUtilChains: false
nodeStatusUpdateFrequency: 2s
syncFrequency: 5s
`, failCgroupV1, n.cgroup, n.ContainerdAddress, port,
		filepath.Join(c.Dir, kubeletServingCertFile), filepath.Join(c.Dir, kubeletServingKeyFile),
		filepath.Join(c.Dir, caCertFile), n.path("pod-logs"), idle)
	if err := os.WriteFile(n.path("kubelet.yaml"), []byte(config), 0o600); err != nil {
		return err
	}
	args := []string{
		"--config=" + n.path("kubelet.yaml"),
		"--kubeconfig=" + filepath.Join(c.Dir, kubeletKubeconfigFile),
		"--root-dir=" + n.path("kubelet"),
		"--hostname-override=" + NodeName,
	}
	p, err := startProcess(Kubelet, n.kubeletBin, args, n.path(kubeletLog))
	if err != nil {
		return err
	}
	n.kubelet = p
	return nil
}

// startScheduler starts kube-scheduler as system:kube-scheduler.
func (n *Node) startScheduler(ctx context.Context) error {
	c := n.c
	port, err := freePort()
	if err != nil {
		return err
	}
	kc := filepath.Join(c.Dir, schedulerKubeconfigFile)
	args := []string{
		"--kubeconfig=" + kc,
		"--authentication-kubeconfig=" + kc,
		"--authorization-kubeconfig=" + kc,
		"--leader-elect=false",
		"--bind-address=127.0.0.1",
		"--secure-port=" + strconv.Itoa(port),
		"--cert-dir=" + n.path("scheduler-certs"),
		"--profiling=false",
	}
	p, err := startProcess(KubeScheduler, n.schedBin, args, n.path(schedulerLog))
	if err != nil {
		return err
	}
	n.scheduler = p
	if err := waitForHealthz(ctx, p, port); err != nil {
		return fmt.Errorf("kube-scheduler not healthy: %w\n--- tail of %s ---\n%s", err, schedulerLog, p.logTail())
	}
	return nil
}

// waitReady waits until the node reports Ready.
func (n *Node) waitReady(ctx context.Context) error {
	var last string
	for {
		if gone, err := n.kubelet.exited(); gone {
			return fmt.Errorf("kubelet exited: %w\n--- tail of %s ---\n%s", err, kubeletLog, n.kubelet.logTail())
		}
		node, err := n.c.Client.CoreV1().Nodes().Get(ctx, NodeName, metav1.GetOptions{})
		if err == nil {
			for _, cond := range node.Status.Conditions {
				if cond.Type == corev1.NodeReady {
					if cond.Status == corev1.ConditionTrue {
						return nil
					}
					last = cond.Reason + ": " + cond.Message
				}
			}
		} else {
			last = err.Error()
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("node %s not Ready: %w (last: %s)\n--- tail of %s ---\n%s", NodeName, ctx.Err(), last, kubeletLog, n.kubelet.logTail())
		case <-time.After(pollInterval):
		}
	}
}

// KubeletLogPath is the kubelet's log file (in Dir, so gone after Stop).
func (n *Node) KubeletLogPath() string { return n.path(kubeletLog) }

// ContainerdLogPath is containerd's log file (in Dir, so gone after Stop).
func (n *Node) ContainerdLogPath() string { return n.path(containerdLog) }

// stop stops the kubelet and the scheduler, kills every container and
// shim of the node, stops containerd, and removes the node's mounts,
// cgroups and bridge: everything the node made outside its directory.
func (n *Node) stop(timeout time.Duration) error {
	var errs []error
	for _, p := range []*process{n.scheduler, n.kubelet} {
		if p != nil {
			if err := p.stop(timeout); err != nil {
				errs = append(errs, err)
			}
		}
	}
	n.scheduler, n.kubelet = nil, nil
	if n.containerd != nil {
		if err := n.containerd.stop(timeout); err != nil {
			errs = append(errs, err)
		}
		n.containerd = nil
	}
	if n.Dir != "" {
		errs = append(errs, cleanUpNode(n.Dir, n.cgroup, n.bridge))
	}
	return errors.Join(errs...)
}

// cleanUpNode removes what a node with this directory, cgroup and bridge
// made outside its directory, whether or not the process that made it is
// still there: the containers (by their cgroups), containerd's shims (by
// their socket), the mounts under dir, the cgroups and the bridge.
func cleanUpNode(dir, cgroup, bridge string) error {
	var errs []error
	killCgroup(cgroup)
	killShims(filepath.Join(dir, "containerd.sock"))
	errs = append(errs, unmountUnder(dir))
	errs = append(errs, removeCgroups(cgroup))
	if bridge != "" {
		if out, err := exec.Command("ip", "link", "delete", bridge).CombinedOutput(); err != nil && !strings.Contains(string(out), "Cannot find device") {
			errs = append(errs, fmt.Errorf("delete bridge %s: %w: %s", bridge, err, strings.TrimSpace(string(out))))
		}
	}
	return errors.Join(errs...)
}

// reapStaleNodes cleans up after nodes whose test process died without
// cleaning up (SIGKILL, a crash): their directories are still in the
// temporary directory and name an owner that is gone.
func reapStaleNodes() {
	owners, _ := filepath.Glob(filepath.Join(os.TempDir(), "testcluster-*", nodeDirName, nodeOwnerFile))
	for _, owner := range owners {
		b, err := os.ReadFile(owner)
		if err != nil {
			continue
		}
		pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
		if err != nil || pid <= 0 || processAlive(pid) {
			continue
		}
		clusterDir := filepath.Dir(filepath.Dir(owner))
		if cleanUpNode(filepath.Dir(owner), nodeCgroup(clusterDir), nodeBridge(clusterDir)) == nil {
			_ = os.RemoveAll(clusterDir)
		}
	}
}

// nodeCgroup is the kubelet's cgroupRoot of the node of the cluster in
// clusterDir, e.g. /tokenbroker-testcluster-123.
func nodeCgroup(clusterDir string) string {
	return "/" + cgroupNamePrefix + filepath.Base(clusterDir)
}

// nodeBridge is the name of the bridge of the node of the cluster in
// clusterDir: at most 15 characters, as Linux wants.
func nodeBridge(clusterDir string) string {
	h := fnv.New32a()
	_, _ = h.Write([]byte(clusterDir))
	return fmt.Sprintf("tb%08x", h.Sum32())
}

// processAlive reports whether a process with this pid exists (and is not a
// zombie that has been reaped).
func processAlive(pid int) bool {
	return syscall.Kill(pid, 0) == nil
}

// NodeImage returns the node image archive in binDir (resolved as for
// Binary), building it with test/image if it is missing (make node-image
// rebuilds it).
func NodeImage(ctx context.Context, binDir string) (string, error) {
	root, err := resolveBinDir(binDir)
	if err != nil {
		return "", err
	}
	path := filepath.Join(root, nodeImageFile)
	if isFile(path) {
		return path, nil
	}
	if err := os.MkdirAll(root, 0o755); err != nil {
		return "", err
	}
	err = withBuildLock(ctx, root, func() error {
		if isFile(path) {
			return nil
		}
		repo, err := repoRoot()
		if err != nil {
			return err
		}
		cmd := exec.CommandContext(ctx, "go", "run", ".", "-node-image", path)
		cmd.Dir = filepath.Join(repo, "test", "image")
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("build the node image: %w\n%s", err, out)
		}
		return nil
	})
	return path, err
}

// The node's credentials, in the cluster's Dir.
const (
	kubeletClientCertFile   = "apiserver-kubelet-client.crt"
	kubeletClientKeyFile    = "apiserver-kubelet-client.key"
	kubeletServingCertFile  = "kubelet.crt"
	kubeletServingKeyFile   = "kubelet.key"
	kubeletKubeconfigFile   = "kubelet.kubeconfig"
	schedulerKubeconfigFile = "kube-scheduler.kubeconfig"
)

// writeNodePKI issues the node's certificates from the cluster CA: the
// kubelet's client (system:node:localhost in system:nodes, what the Node
// authorizer knows) and serving certificates, the API server's client
// certificate for the kubelet, and the scheduler's (system:kube-scheduler,
// which the RBAC bootstrap policy binds), and writes the kubeconfigs.
func (c *Cluster) writeNodePKI(ca *keyPair, url string) error {
	now := time.Now()
	dir := c.Dir
	client := func(cn string, orgs ...string) (*keyPair, error) {
		return issue(ca, now, &x509.Certificate{
			Subject:     pkix.Name{CommonName: cn, Organization: orgs},
			ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
		})
	}
	apiClient, err := client("kube-apiserver-kubelet-client", "system:masters")
	if err != nil {
		return err
	}
	if err := writeCertAndKey(dir, kubeletClientCertFile, kubeletClientKeyFile, encodeCert(apiClient.cert), apiClient.key); err != nil {
		return err
	}
	serving, err := issue(ca, now, &x509.Certificate{
		Subject:     pkix.Name{CommonName: NodeName},
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		DNSNames:    []string{NodeName},
		IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1), net.IPv6loopback},
	})
	if err != nil {
		return err
	}
	if err := writeCertAndKey(dir, kubeletServingCertFile, kubeletServingKeyFile, encodeCert(serving.cert), serving.key); err != nil {
		return err
	}
	for file, subject := range map[string][]string{
		kubeletKubeconfigFile:   {"system:node:" + NodeName, "system:nodes"},
		schedulerKubeconfigFile: {"system:kube-scheduler"},
	} {
		kp, err := client(subject[0], subject[1:]...)
		if err != nil {
			return err
		}
		key, err := encodeKey(kp.key)
		if err != nil {
			return err
		}
		kc := clientcmdapi.NewConfig()
		kc.Clusters[kubeconfigName] = &clientcmdapi.Cluster{Server: url, CertificateAuthorityData: encodeCert(ca.cert)}
		kc.AuthInfos[subject[0]] = &clientcmdapi.AuthInfo{ClientCertificateData: encodeCert(kp.cert), ClientKeyData: key}
		kc.Contexts[kubeconfigName] = &clientcmdapi.Context{Cluster: kubeconfigName, AuthInfo: subject[0]}
		kc.CurrentContext = kubeconfigName
		if err := clientcmd.WriteToFile(*kc, filepath.Join(dir, file)); err != nil {
			return fmt.Errorf("write %s: %w", file, err)
		}
	}
	return nil
}
