// Package vaultengine drives HashiCorp Vault's Kubernetes secrets engine
// (github.com/hashicorp/vault-plugin-secrets-kubernetes, the version this
// module requires) in process, through its logical backend with in-memory
// storage, against a real kube-apiserver. The bench (test/cmd/bench) times
// it side by side with the broker; its test checks that what it times works.
//
// Nothing of Vault's server is here: no HTTP layer, no token store, no
// expiration manager, no persistent storage. What is left is the plugin's
// own request handling, its writes to Kubernetes and its revoke, so a
// figure measured here is a lower bound for a Vault server.
//
// The engine is driven in one of two modes, the two ways the plugin is
// used to hand out a token for a namespace:
//
//   - Unrevocable: a Vault role with service_account_name. Each credential
//     is one TokenRequest for an existing ServiceAccount; revoking the
//     Vault lease deletes nothing, so the token is good until it expires.
//   - Revocable: a Vault role with kubernetes_role_name. Each credential
//     is a RoleBinding (to an existing Role), a ServiceAccount and a
//     TokenRequest for it; revoking the lease deletes the RoleBinding and
//     the ServiceAccount, and with the ServiceAccount the token.
//
// Each mode runs either as shipped, with the client the plugin builds for
// itself (client-go's default client-side limiter: QPS 5, burst 10 per
// API group, because its rest.Config sets neither), or with that limiter
// lifted (see Config.LiftLimiter for how).
package vaultengine

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"runtime/debug"
	"time"
	"unsafe"

	"github.com/hashicorp/go-hclog"
	kubesecrets "github.com/hashicorp/vault-plugin-secrets-kubernetes"
	"github.com/hashicorp/vault/sdk/logical"
	authnv1 "k8s.io/api/authentication/v1"
	authorizationv1 "k8s.io/api/authorization/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/tokenbroker/tokenbroker/test/testcluster"
)

// PluginModule is the Go module of the engine.
const PluginModule = "github.com/hashicorp/vault-plugin-secrets-kubernetes"

// PluginVersion is the version of PluginModule built into this binary, as
// the module graph resolved it ("unknown" without build information).
func PluginVersion() string {
	if bi, ok := debug.ReadBuildInfo(); ok {
		for _, d := range bi.Deps {
			if d.Path == PluginModule {
				if d.Replace != nil {
					return d.Replace.Version
				}
				return d.Version
			}
		}
	}
	return "unknown"
}

// Mode is how the engine's Vault role makes a credential.
type Mode string

const (
	// Unrevocable is a role with service_account_name: a TokenRequest for
	// an existing ServiceAccount, valid until it expires.
	Unrevocable Mode = "unrevocable"
	// Revocable is a role with kubernetes_role_name: a ServiceAccount and a
	// RoleBinding per credential, deleted on revoke.
	Revocable Mode = "revocable"
)

// LiftedLimiter says how Config.LiftLimiter lifts the plugin's client-side
// limiter, for the bench's output.
const LiftedLimiter = "the plugin has no setting for its client-side limiter (its newClient builds a rest.Config of " +
	"Host, BearerToken and CAData only, so client-go applies QPS 5, burst 10 per API group); the driver sets the " +
	"backend's unexported client field (reflect and unsafe, after the config write that resets it) to a clientset " +
	"built from that same rest.Config with QPS and Burst set; everything else - request handling, WAL, names, " +
	"revoke - is the plugin's own code"

// Config says where the engine talks to and how its role makes credentials.
type Config struct {
	// Host and CAData are the API server's URL and CA bundle: the plugin's
	// kubernetes_host and kubernetes_ca_cert.
	Host   string
	CAData []byte
	// Token is the plugin's own identity in the cluster, its
	// service_account_jwt (see Grant).
	Token string
	// Namespace is where credentials are made (the role's only allowed
	// namespace).
	Namespace string
	Mode      Mode
	// ServiceAccount is the existing ServiceAccount of Unrevocable.
	ServiceAccount string
	// Role is the existing Role that Revocable binds each new
	// ServiceAccount to.
	Role string
	// TTL is the role's token_default_ttl (at least 10m, the
	// TokenRequest minimum).
	TTL time.Duration
	// LiftLimiter, when QPS is not zero, replaces the client the plugin
	// would build with one built the same way but with this QPS and
	// Burst (QPS < 0: no limiter at all). The plugin has no setting for
	// it; see LiftedLimiter for how.
	LiftLimiter Limit
}

// Limit is a client-go client-side limit.
type Limit struct {
	QPS   float32
	Burst int
}

// Engine is one mounted instance of the plugin with one Vault role.
type Engine struct {
	backend logical.Backend
	storage logical.Storage
	role    string
	ns      string
}

// Credential is what one credential request returned.
type Credential struct {
	// Token is the ServiceAccount token. Never log it.
	Token          string
	Namespace      string
	ServiceAccount string
	// secret is the lease as Vault core would keep it, for Revoke.
	secret *logical.Secret
}

// roleName is the Vault role the engine configures.
const roleName = "bench"

// New mounts the plugin with in-memory storage, writes its config and a
// role for cfg.Mode, and, when asked, lifts its client-side limiter.
func New(ctx context.Context, cfg Config) (*Engine, error) {
	storage := &logical.InmemStorage{}
	be, err := kubesecrets.Factory(ctx, &logical.BackendConfig{
		Logger: hclog.NewNullLogger(),
		System: &logical.StaticSystemView{DefaultLeaseTTLVal: time.Hour, MaxLeaseTTLVal: 24 * time.Hour},
		Config: map[string]string{},
	})
	if err != nil {
		return nil, fmt.Errorf("mount the kubernetes secrets engine: %w", err)
	}
	e := &Engine{backend: be, storage: storage, role: roleName, ns: cfg.Namespace}
	if _, err := e.call(ctx, logical.UpdateOperation, "config", map[string]any{
		"kubernetes_host":      cfg.Host,
		"kubernetes_ca_cert":   string(cfg.CAData),
		"service_account_jwt":  cfg.Token,
		"disable_local_ca_jwt": true,
	}); err != nil {
		return nil, fmt.Errorf("write the engine's config: %w", err)
	}
	role := map[string]any{
		"allowed_kubernetes_namespaces": []string{cfg.Namespace},
		"token_default_ttl":             int(cfg.TTL.Seconds()),
	}
	switch cfg.Mode {
	case Unrevocable:
		role["service_account_name"] = cfg.ServiceAccount
	case Revocable:
		role["kubernetes_role_name"] = cfg.Role
		role["kubernetes_role_type"] = "Role"
	default:
		return nil, fmt.Errorf("unknown mode %q", cfg.Mode)
	}
	if _, err := e.call(ctx, logical.CreateOperation, "roles/"+roleName, role); err != nil {
		return nil, fmt.Errorf("write the engine's role: %w", err)
	}
	if cfg.LiftLimiter.QPS != 0 {
		// After the config write: writing config resets the client.
		rc := &rest.Config{Host: cfg.Host, BearerToken: cfg.Token, QPS: cfg.LiftLimiter.QPS, Burst: cfg.LiftLimiter.Burst}
		rc.TLSClientConfig.CAData = cfg.CAData
		if err := setClient(be, rc); err != nil {
			return nil, fmt.Errorf("lift the engine's client-side limiter: %w", err)
		}
	}
	return e, nil
}

// setClient sets be's Kubernetes client to a clientset for rc. The plugin
// (v0.12.0: backend.go, client.go) keeps it as
//
//	type backend struct { ...; client *client; ... }
//	type client struct { k8s kubernetes.Interface }
//
// and builds it lazily in getClient only while the field is nil, from a
// rest.Config with Host, BearerToken and CAData, so QPS 0 and Burst 0:
// client-go's defaults, 5 and 10, one bucket per API group's REST client.
// Both names are unexported and there is no option, environment variable
// or package variable for the limit (rest.DefaultQPS is a constant), so
// the fields are found by reflection and written through unsafe. Every
// step is checked; a plugin version with another shape fails here rather
// than running as shipped under a "lifted" label.
func setClient(be logical.Backend, rc *rest.Config) error {
	v := reflect.ValueOf(be)
	if v.Kind() != reflect.Pointer || v.Elem().Kind() != reflect.Struct {
		return fmt.Errorf("backend is a %s, not a pointer to a struct", v.Type())
	}
	f := v.Elem().FieldByName("client")
	if !f.IsValid() || f.Kind() != reflect.Pointer || f.Type().Elem().Kind() != reflect.Struct {
		return fmt.Errorf("%s has no field client *struct", v.Elem().Type())
	}
	c := reflect.New(f.Type().Elem())
	k := c.Elem().FieldByName("k8s")
	ifaceType := reflect.TypeFor[kubernetes.Interface]()
	if !k.IsValid() || k.Type() != ifaceType {
		return fmt.Errorf("%s has no field k8s %s", f.Type().Elem(), ifaceType)
	}
	cs, err := kubernetes.NewForConfig(rc)
	if err != nil {
		return err
	}
	reflect.NewAt(k.Type(), unsafe.Pointer(k.UnsafeAddr())).Elem().Set(reflect.ValueOf(cs))
	reflect.NewAt(f.Type(), unsafe.Pointer(f.UnsafeAddr())).Elem().Set(c)
	return nil
}

// Issue asks the engine for a credential, as "vault write
// kubernetes/creds/ROLE kubernetes_namespace=NS" would.
func (e *Engine) Issue(ctx context.Context) (*Credential, error) {
	resp, err := e.call(ctx, logical.UpdateOperation, "creds/"+e.role, map[string]any{"kubernetes_namespace": e.ns})
	if err != nil {
		return nil, err
	}
	if resp.Secret == nil {
		return nil, errors.New("credential response has no lease")
	}
	token, _ := resp.Data["service_account_token"].(string)
	sa, _ := resp.Data["service_account_name"].(string)
	ns, _ := resp.Data["service_account_namespace"].(string)
	if token == "" {
		return nil, errors.New("credential response has no token")
	}
	// Vault core keeps a lease's internal data JSON-encoded and hands it
	// back on revoke: do the same, so that revoke sees what it would see.
	raw, err := json.Marshal(resp.Secret.InternalData)
	if err != nil {
		return nil, fmt.Errorf("encode the lease's internal data: %w", err)
	}
	secret := &logical.Secret{LeaseOptions: resp.Secret.LeaseOptions}
	if err := json.Unmarshal(raw, &secret.InternalData); err != nil {
		return nil, fmt.Errorf("decode the lease's internal data: %w", err)
	}
	return &Credential{Token: token, Namespace: ns, ServiceAccount: sa, secret: secret}, nil
}

// Revoke revokes cred's lease through the backend, as Vault's expiration
// manager does on "vault lease revoke" (logical.RevokeOperation with the
// lease's internal data).
func (e *Engine) Revoke(ctx context.Context, cred *Credential) error {
	_, err := e.handle(ctx, &logical.Request{Operation: logical.RevokeOperation, Path: "creds/" + e.role, Secret: cred.secret, Storage: e.storage})
	return err
}

func (e *Engine) call(ctx context.Context, op logical.Operation, path string, data map[string]any) (*logical.Response, error) {
	return e.handle(ctx, &logical.Request{Operation: op, Path: path, Data: data, Storage: e.storage, DisplayName: "bench"})
}

func (e *Engine) handle(ctx context.Context, req *logical.Request) (*logical.Response, error) {
	resp, err := e.backend.HandleRequest(ctx, req)
	if err != nil {
		return nil, fmt.Errorf("%s %s: %w", req.Operation, req.Path, err)
	}
	if resp != nil && resp.IsError() {
		return nil, fmt.Errorf("%s %s: %w", req.Operation, req.Path, resp.Error())
	}
	return resp, nil
}

// GrantRules are what the plugin's identity may do: the rules of the
// plugin's own integration tests (integrationtest/vault/testRoles.yaml,
// ClusterRole k8s-secrets-abilities), plus bind on roles so that it may
// bind a Role whose permissions it does not hold itself.
var GrantRules = []rbacv1.PolicyRule{
	{APIGroups: []string{""}, Resources: []string{"serviceaccounts/token"}, Verbs: []string{"create"}},
	{APIGroups: []string{""}, Resources: []string{"namespaces"}, Verbs: []string{"get"}},
	{APIGroups: []string{""}, Resources: []string{"serviceaccounts"}, Verbs: []string{"create", "delete"}},
	{APIGroups: []string{"rbac.authorization.k8s.io"}, Resources: []string{"rolebindings", "roles", "clusterrolebindings", "clusterroles"}, Verbs: []string{"create", "delete"}},
	{APIGroups: []string{"rbac.authorization.k8s.io"}, Resources: []string{"roles", "clusterroles"}, Verbs: []string{"bind"}},
}

// Grant gives the plugin an identity in the cluster as an operator would:
// ServiceAccount vault in namespace, bound to a ClusterRole of GrantRules,
// and returns a token of it valid for ttl (the plugin's
// service_account_jwt). admin must be allowed to create all that.
func Grant(ctx context.Context, admin kubernetes.Interface, namespace string, ttl time.Duration) (string, error) {
	const name = "vault"
	if _, err := admin.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: namespace}}, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return "", fmt.Errorf("create namespace %s: %w", namespace, err)
	}
	if _, err := admin.CoreV1().ServiceAccounts(namespace).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: name}}, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return "", fmt.Errorf("create the plugin's ServiceAccount: %w", err)
	}
	if _, err := admin.RbacV1().ClusterRoles().Create(ctx, &rbacv1.ClusterRole{ObjectMeta: metav1.ObjectMeta{Name: "vault-kubernetes-secrets"}, Rules: GrantRules}, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return "", fmt.Errorf("create the plugin's ClusterRole: %w", err)
	}
	if _, err := admin.RbacV1().ClusterRoleBindings().Create(ctx, &rbacv1.ClusterRoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: "vault-kubernetes-secrets"},
		RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: "vault-kubernetes-secrets"},
		Subjects:   []rbacv1.Subject{{Kind: rbacv1.ServiceAccountKind, Name: name, Namespace: namespace}},
	}, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return "", fmt.Errorf("bind the plugin's ClusterRole: %w", err)
	}
	// The plugin uses the binding at once; the authorizer sees it a moment
	// after it is written.
	var attrs []authorizationv1.ResourceAttributes
	for _, r := range GrantRules {
		attrs = append(attrs, testcluster.RuleAttributes(r, namespace))
	}
	user, groups := testcluster.ServiceAccountUser(namespace, name)
	if err := testcluster.WaitAllowed(ctx, admin, user, groups, attrs...); err != nil {
		return "", err
	}
	seconds := int64(ttl.Seconds())
	tr, err := admin.CoreV1().ServiceAccounts(namespace).CreateToken(ctx, name,
		&authnv1.TokenRequest{Spec: authnv1.TokenRequestSpec{ExpirationSeconds: &seconds}}, metav1.CreateOptions{})
	if err != nil {
		return "", fmt.Errorf("create the plugin's token: %w", err)
	}
	return tr.Status.Token, nil
}
